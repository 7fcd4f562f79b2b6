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


# ---- refuse first: the plan on what is known decides before the pass runs -----------------------------

@pytest.fixture
def unmeasured_cpu(monkeypatch):
    """A CPU of a class whose table came from another CPU model: its plans carry the unmeasured margin."""
    from bigmem.memory import calibration

    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "amx")
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: "a CPU no table was measured on")
    return calibration.UNMEASURED_MARGIN_BYTES


def _known_plan(config):
    """The plan on what is known (no refusal): its peak and the bytes it adds for what is not measured."""
    from bigmem.memory.budget import resolve_budget

    plan = job._plan(config, SingleProcess(1), None, resolve_budget(2**50), force=True, loader=None)
    return plan.predicted_peak_bytes, job.unmeasured_bytes(plan)


def _with_budget(budget_bytes):
    return resolve_config("tiny", {"train": {"batch_size": 1}, "data": {"shape": [16, 16, 32]},
                                   "memory": {"budget_bytes": int(budget_bytes)}})


def test_a_job_over_its_budget_by_more_than_the_margin_is_refused_before_the_pass(ran, unmeasured_cpu):
    from bigmem.errors import InsufficientMemoryError

    peak, margin = _known_plan(_with_budget(2**40))
    assert margin >= unmeasured_cpu  # the fixed part at least
    with pytest.raises(InsufficientMemoryError, match=r"^Predicted peak "):
        job.refuse_then_measure(_with_budget(peak - margin - 2**20), SingleProcess(1), None, force=False,
                                console=_console())
    assert ran == []


def test_a_job_within_the_margin_is_measured_then_decided(ran, unmeasured_cpu, tmp_path, monkeypatch):
    import bigmem.tune

    fake_pass = bigmem.tune.run_with_progress

    def measuring_pass(config, shape, console, **options):  # the pass measures this CPU's term: as the table's
        made = fake_pass(config, shape, console, **options)
        made.overhead_offset_bytes[bigmem.tune.fixed_memory_key(config)] = 0
        tuning.save_tuning(made)
        return made

    monkeypatch.setattr(bigmem.tune, "run_with_progress", measuring_pass)
    peak, margin = _known_plan(_with_budget(2**40))
    out = tmp_path / "said.txt"
    with out.open("w") as said:
        plan, _ = job.refuse_then_measure(_with_budget(peak - margin // 2), SingleProcess(1), None, force=False,
                                          console=Console(file=said, width=400))
    assert ran == [("fp32", (16, 16, 32))]
    assert "by less than its margin for terms not measured on this machine" in out.read_text()
    assert plan.predicted_peak_bytes < peak - margin // 2  # measured: the fixed margin is gone, and it fits


def test_a_job_that_fits_runs_the_pass_before_its_plan(ran, unmeasured_cpu):
    peak, _ = _known_plan(_with_budget(2**40))
    plan, _ = job.refuse_then_measure(_with_budget(2 * peak), SingleProcess(1), None, force=False, console=_console())
    assert ran == [("fp32", (16, 16, 32))]
    assert plan.fits is True


def test_a_forced_job_is_never_refused_and_still_tuned(ran, unmeasured_cpu):
    plan, _ = job.refuse_then_measure(_with_budget(2**20), SingleProcess(1), None, force=True, console=_console())
    assert ran == [("fp32", (16, 16, 32))]
    assert plan.forced is True
