"""A kill at any moment loses at most one checkpoint interval.

``bigmem train`` is killed with SIGKILL during start-up, mid-step and during a checkpoint write,
resumed each time with the same command plus --resume, and the finished run must equal an
uninterrupted one of the same seed. The driver is benchmarks/robustness/bench_chaos.py, which does the same
with 20 kills (benchmarks/results/chaos-*.json).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

CHECKPOINT_EVERY = 4
STEPS = 24


def _driver():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "robustness" / "bench_chaos.py"
    spec = importlib.util.spec_from_file_location("bench_chaos", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_store):
    chaos = _driver()
    settings = chaos.Settings(tiny_store, steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, volume=32, seed=1)
    report = chaos.chaos(settings, tmp_path, kills=3, seed=18, phases=("start-up", "mid-step", "checkpoint write"))
    kills, final = report["kills"], report["final"]
    assert [k["phase"] for k in kills] == ["start-up", "mid-step", "checkpoint write"]
    for kill in kills:
        assert not kill["exited_first"], kill
        assert kill["json_errors"] == [], kill
        assert kill["misplaced_torn_lines"] == 0, kill
        assert 0 <= kill["lost_steps"] <= CHECKPOINT_EVERY, kill
    assert kills[0]["last_logged_step"] == 0  # killed before its first step
    assert kills[1]["checkpoint_step"] == CHECKPOINT_EVERY < kills[1]["last_logged_step"]  # between checkpoints
    assert kills[2]["started"] == f"from ckpt-{CHECKPOINT_EVERY:08d}", kills[2]
    assert kills[2]["in_checkpoint_write"], kills[2]
    assert final["started"] == f"from ckpt-{CHECKPOINT_EVERY:08d}"  # the write killed did not count
    # every launch went on from the checkpoint the kill before it left (or started the run, before any)
    launches = [*(k["started"] for k in kills[1:]), final["started"]]
    for before, started in zip(kills, launches):
        if started is None:  # killed before it said how it started
            continue
        step = before["checkpoint_step"]
        assert started == (f"from ckpt-{step:08d}" if step else started if started in ("new", "over") else "?")
    assert final["exit_code"] == 0, final["log_tail"]
    assert final["steps"] == list(range(1, STEPS + 1))
    assert final["torn_metrics_lines"] == 0
    assert final["loss"] == pytest.approx(final["reference_loss"], rel=1e-4)
    assert final["max_step_loss_rel_diff"] <= 1e-4
    assert final["model_keras"]
    assert final["leftovers"] == []
