"""``train/callbacks.py``: what a run does besides stepping, each callback in a loop with a fake step and batches."""

from __future__ import annotations

import math
import os
import re
import signal

import pytest
from rich.console import Console

from bigmem.errors import TrainingError
from bigmem.rundir import RunDir, read_jsonl
from bigmem.train import callbacks as cb
from bigmem.train.loop import Callback, LoopState, run_loop
from bigmem.train.resume import Restored


def _losses(values):
    values = iter(values)
    return lambda images, labels: (next(values), 0.5)


def _loop(state, callbacks, losses=None, shape_for_step=None):
    batches = iter([(None, None)] * 100)
    step = _losses(losses or [1.0] * 100)
    return run_loop(state, step, batches, callbacks, learning_rate=lambda s: 0.1 * (s + 1),
                    voxels_for_step=lambda step: 1000, shape_for_step=shape_for_step,
                    input_error=lambda: None)


def test_metrics_every_k_steps_and_the_last(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    _loop(LoopState(0, 7), [cb.MetricsLog(run, log_every=3)])
    assert [r["step"] for r in read_jsonl(run.metrics)] == [3, 6, 7]


class FakeCheckpoints:
    def __init__(self):
        self.saved, self.states = [], []

    def save(self, step, model, optimizer, extra):
        self.saved.append(step)
        self.states.append(extra)
        return f"ckpt-{step}"

    def latest(self):
        return f"ckpt-{self.saved[-1]}" if self.saved else None


def test_the_non_finite_guard_stops_before_the_step_is_recorded_or_saved(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    saves = FakeCheckpoints()
    callbacks = [cb.NonFiniteGuard(saves), cb.MetricsLog(run, 1), cb.Checkpoints(saves, 2, None, None)]
    with pytest.raises(TrainingError, match=r"^Loss is nan at step 3: training stopped; the newest good checkpoint "
                                            r"is ckpt-2\. Try a lower train\.lr or train\.precision fp32\.$"):
        _loop(LoopState(0, 6), callbacks, losses=[1.0, 1.0, float("nan")])
    assert [r["step"] for r in read_jsonl(run.metrics)] == [1, 2]
    assert saves.saved == [2]


def test_checkpoints_every_k_at_the_end_and_when_stopped_early():
    saves = FakeCheckpoints()
    _loop(LoopState(0, 5), [cb.Checkpoints(saves, 2, None, None)])
    assert saves.saved == [2, 4, 5]

    class StopAt3(Callback):
        def on_step_end(self, state):
            if state.step == 3:
                state.stop = "test"

    saves = FakeCheckpoints()
    state = _loop(LoopState(0, 10), [cb.Checkpoints(saves, 2, None, None), StopAt3()])
    assert (state.step, state.stop, saves.saved) == (3, "test", [2, 3])


def test_time_budget_ends_the_run_after_the_step_that_reaches_it():
    ticks = iter(range(100))
    state = _loop(LoopState(0, 50), [cb.TimeBudget(2.5, clock=lambda: float(next(ticks)))])
    # begin at t=1 (t=0 was construction); steps end at t=2, 3, 4: 4 - 1 >= 2.5 after the third
    assert (state.step, state.stop) == (3, "time budget")
    assert _loop(LoopState(0, 50), [cb.TimeBudget(0.0)]).step == 0


def test_time_spent_validating_is_not_training_time():
    class SlowValidation(Callback):  # 10 s of other work after every step, as Validation records it
        def on_step_end(self, state):
            state.excluded_s += 10.0

    now = [0.0]

    def clock():
        now[0] += 1.0 + (10.0 if now[0] > 1 else 0.0)  # each step: 1 s training + 10 s validation
        return now[0]

    state = _loop(LoopState(0, 50), [SlowValidation(), cb.TimeBudget(2.5, clock=clock)])
    assert (state.step, state.stop, state.excluded_s) == (3, "time budget", 30.0)


def test_a_signal_stops_after_the_current_step_and_restores_the_handler():
    class SendSigterm(Callback):
        def on_step_end(self, state):
            if state.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    state = _loop(LoopState(0, 10), [SendSigterm(), cb.StopOnSignal()])
    assert (state.step, state.stop, state.interrupted_by) == (2, "signal", signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_checkpoint_records_what_a_resume_restores():
    saves = FakeCheckpoints()
    _loop(LoopState(0, 3), [cb.Checkpoints(saves, 2, None, None)], losses=[3.0, 2.0, 1.5])
    assert saves.saved == [2, 3]
    assert saves.states == [{"total_steps": 3, "loss": 2.0, "dice": 0.5}, {"total_steps": 3, "loss": 1.5, "dice": 0.5}]
    # state.json is the state plus the step (CheckpointManager); a resume starts from it
    assert Restored.from_state({**saves.states[-1], "step": 3}) == Restored(step=3, loss=1.5, dice=0.5)
    fresh = Restored()
    assert fresh.step == 0
    assert math.isnan(fresh.loss)
    assert math.isnan(fresh.dice)


def test_shape_stats_count_the_steps_per_shape_and_the_padding_per_epoch():
    traces = [0]

    def shape_for_step(step):  # the first two steps at one shape, the next two at another
        traces[0] = 1 + step // 2
        return (16, 16, 16) if step < 2 else (32, 16, 16)

    console = Console(record=True, width=200)
    shapes = cb.ShapeStats(console, lambda: traces[0], padding_share=lambda epoch: 0.125 * epoch, steps_per_epoch=3)
    _loop(LoopState(0, 4), [shapes], shape_for_step=shape_for_step)
    summary = shapes.summary()
    assert summary["traces"] == 2
    assert summary["compile_s"] >= 0
    assert summary["steps_per_shape"] == {"16x16x16": 2, "32x16x16": 2}
    assert summary["padding_share_per_epoch"] == [0.0, 0.125]  # steps 1-3 are epoch 0, step 4 epoch 1
    assert re.fullmatch(r"Compiled the step 2 times for 2 shapes \(\d+\.\d s beyond their later steps\); padding "
                        r"0\.0%, 12\.5% per epoch\.\n", console.export_text())


def test_one_shape_says_nothing():
    console = Console(record=True)
    shapes = cb.ShapeStats(console, lambda: 1, padding_share=lambda epoch: 0.0, steps_per_epoch=2)
    _loop(LoopState(0, 3), [shapes], shape_for_step=lambda step: (16, 16, 16))
    assert console.export_text() == ""
    assert shapes.summary()["steps_per_shape"] == {"16x16x16": 3}
