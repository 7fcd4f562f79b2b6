"""A ``CompareReport`` built from chosen held-out Dice, for the report's and the renderers' tests."""

from __future__ import annotations

import pytest

from bigmem.compare.report import ClassScore, CompareReport, CurvePoint, HeldOut, PathResult, SeedRun, TrainingRun


def _run(seed: int, dice: float, steps: int, mode: str) -> SeedRun:
    training = TrainingRun(f"/cmp/seed-{seed}", steps, 1.0 + seed, 0.01, 4e5, 640 * 2**20, 0.03,
                           (CurvePoint(1, 0.5, 0.02), CurvePoint(2, 1.0, 0.03, val_dice=dice)))
    # class 2 scored by no case (None), as evaluate reports a class absent from every reference
    held_out = HeldOut(mode, dice, 9.0 + seed, {"1": ClassScore(dice, 9.0 + seed), "2": ClassScore(None, None)},
                       0.4, 600 * 2**20, f"/cmp/seed-{seed}-predictions")
    return SeedRun(seed, training, steps * 4e7, 100.0, held_out)


def _make_report(cpu_dice: list[float], dp_dice: list[float], *,
                 budget: str = "equal training time (120 s of training each)", simulated: bool = True,
                 stand_in: str | None = None) -> CompareReport:
    cpu = PathResult.over_seeds([_run(s, d, 4, "whole") for s, d in enumerate(cpu_dice)], max_whole_volume=568,
                                max_whole_volume_mode="bf16, recompute stages")
    dp = PathResult.over_seeds([_run(s, d, 16, "sliding 8^3, overlap 0.5") for s, d in enumerate(dp_dice)],
                               max_whole_volume=8)
    return CompareReport(simulated, 2, 2**30, stand_in, "tiny", 16, (16, 16, 16), False, (8, 8, 8),
                         {"cpu_bigmem": 1, "data_parallel": 2}, ("synth_0003",), budget, len(cpu_dice),
                         {"cpu_bigmem": cpu, "data_parallel": dp})


@pytest.fixture
def make_report():
    """``make_report(cpu_dice, dp_dice, budget=..., simulated=True, stand_in=None)``: one seed per Dice value."""
    return _make_report
