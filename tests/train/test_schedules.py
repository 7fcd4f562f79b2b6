"""Warmup + polynomial decay, evaluated at its corners."""

from __future__ import annotations

import pytest

from bigmem.train.schedules import WarmupPolynomialDecay


def test_warmup_then_polynomial_decay():
    schedule = WarmupPolynomialDecay(base_lr=0.1, total_steps=110, warmup_steps=10, power=2.0, end_lr=0.0)
    lr = lambda step: float(schedule(step))  # noqa: E731
    assert lr(0) == pytest.approx(0.01)
    assert lr(4) == pytest.approx(0.05)
    assert lr(10) == pytest.approx(0.1)
    assert lr(60) == pytest.approx(0.1 * 0.5**2)
    assert lr(110) == pytest.approx(0.0)
    assert lr(500) == pytest.approx(0.0)


def test_schedule_config_round_trip():
    schedule = WarmupPolynomialDecay(0.2, 50, 5, 1.0, 0.01)
    again = WarmupPolynomialDecay(**schedule.get_config())
    assert [float(again(s)) for s in (0, 7, 49)] == [float(schedule(s)) for s in (0, 7, 49)]


def test_warmup_longer_than_run_is_clamped():
    schedule = WarmupPolynomialDecay(0.1, total_steps=3, warmup_steps=20)
    assert schedule.warmup_steps == 2
