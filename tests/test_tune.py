"""The tuning pass's fixed memory: the lowest of several measured draws against the shipped table."""

from __future__ import annotations

import types

import bigmem.memory.measure
from bigmem import tune
from bigmem.config import resolve_config
from bigmem.memory import calibration
from bigmem.nets import tuning

MIB = 2**20


def _fixed_with_peaks(monkeypatch, tmp_path, peaks: list[int]) -> tuple[int, int]:
    """``fixed_memory`` of small (avx2 tables, no tuning file) with ``measure`` answering ``peaks`` in turn;
    (term, calls)."""
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "tuning"))
    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "avx2")
    answers = iter(peaks)
    calls = []

    def fake_measure(config, shape, **_):
        calls.append(tuple(shape))
        return types.SimpleNamespace(peak_bytes=next(answers))

    monkeypatch.setattr(bigmem.memory.measure, "measure", fake_measure)
    (term,) = tune.fixed_memory(resolve_config("small")).values()
    return term, len(calls)


def test_fixed_memory_is_the_lowest_draw(monkeypatch, tmp_path):
    zero, _ = _fixed_with_peaks(monkeypatch, tmp_path, [0] * tune.FIXED_MEMORY_DRAWS)
    predicted = -zero
    draws = [predicted + 300 * MIB, predicted + 100 * MIB, predicted + 200 * MIB][:tune.FIXED_MEMORY_DRAWS]
    term, _ = _fixed_with_peaks(monkeypatch, tmp_path, draws)
    assert term == min(draws) - predicted


def test_fixed_memory_measures_every_draw(monkeypatch, tmp_path):
    _, calls = _fixed_with_peaks(monkeypatch, tmp_path, [0] * tune.FIXED_MEMORY_DRAWS)
    assert calls == tune.FIXED_MEMORY_DRAWS


def test_fixed_memory_takes_more_than_one_draw():
    assert tune.FIXED_MEMORY_DRAWS >= 2
