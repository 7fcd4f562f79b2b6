"""train runs the tuning pass once per precision on a machine, before it plans, unless told not to."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from bigmem.config import resolve_config
from bigmem.distribute.execution import SingleProcess
from bigmem.nets import choices, tuning
from bigmem.train import job


@pytest.fixture
def ran(tmp_path, monkeypatch):
    """The shapes the pass was asked to tune (it is replaced by one that writes a file and times nothing)."""
    import bigmem.tune

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "tuning"))
    monkeypatch.delenv(job.NO_TUNE_VARIABLE, raising=False)
    choices.kernel_choices.cache_clear()
    shapes = []

    def fake(config, shape, console, **_):
        shapes.append((config.train.precision.value, tuple(shape)))
        made = tuning.Tuning(key=dataclasses.asdict(tuning.key_here()), planewise={}, conv_gflops_per_core={},
                             overhead_offset_bytes={}, rows=[],
                             tuned=[{"model": config.model.name, "shape": list(shape),
                                     "precision": config.train.precision.value, "seconds": 0.0}])
        tuning.save_tuning(made)
        return made

    def fake_fixed(config):  # the memory step alone, as a tuned machine runs it for a network it has no term for
        shapes.append(("fixed memory", config.model.name))
        made = tuning.load_tuning()
        made.overhead_offset_bytes[bigmem.tune.fixed_memory_key(config)] = 0
        tuning.save_tuning(made)
        return made

    monkeypatch.setattr(bigmem.tune, "run_with_progress", fake)
    monkeypatch.setattr(bigmem.tune, "measure_fixed_memory", fake_fixed)
    yield shapes
    choices.kernel_choices.cache_clear()


def _config(**train):
    return resolve_config("tiny", {"train": {"batch_size": 1, **train}, "data": {"shape": [16, 16, 32]}})


def _console():
    return Console(file=open("/dev/null", "w"))


def test_the_first_run_tunes_at_its_shape(ran):
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    assert ran == [("fp32", (16, 16, 32))]


def test_a_tuned_precision_is_not_tuned_again(ran):
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    assert ran[1:] == [("fixed memory", "tiny")]  # the pass's fake measured no fixed term
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    assert len(ran) == 2


def test_a_tuned_machine_measures_the_fixed_term_of_a_network_it_has_none_for(ran):
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    small = resolve_config("small", {"train": {"batch_size": 1}, "data": {"shape": [16, 16, 32]}})
    job.auto_tune(small, SingleProcess(1), None, _console())
    assert ran == [("fp32", (16, 16, 32)), ("fixed memory", "small")]


def test_no_tune_keeps_the_shipped_tables(ran):
    job.auto_tune(_config(tune=False), SingleProcess(1), None, _console())
    assert ran == []


def test_the_variable_turns_it_off_too(ran, monkeypatch):
    monkeypatch.setenv(job.NO_TUNE_VARIABLE, "1")
    job.auto_tune(_config(), SingleProcess(1), None, _console())
    assert ran == []


def test_emulated_bf16_is_not_tuned(ran, monkeypatch):
    monkeypatch.setenv("BIGMEM_NATIVE_BF16", "0")
    job.auto_tune(_config(precision="bf16"), SingleProcess(1), None, _console())
    assert ran == []
