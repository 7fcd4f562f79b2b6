"""The loop and its callbacks, without a model: a fake step, fake batches, a real run directory."""

from __future__ import annotations

import os
import signal

import pytest

from bigmem.errors import TrainingError
from bigmem.rundir import RunDir, read_jsonl
from bigmem.train import callbacks as cb
from bigmem.train.loop import Callback, LoopState, run_loop


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, state):
        self.events.append(("begin", state.step))

    def on_step_end(self, state):
        self.events.append(("step", state.step))

    def on_train_end(self, state):
        self.events.append(("end", state.step))


def _losses(values):
    values = iter(values)
    return lambda images, labels: (next(values), 0.5)


def _loop(state, callbacks, losses=None):
    batches = iter([(None, None)] * 100)
    step = _losses(losses or [1.0] * 100)
    return run_loop(state, step, batches, callbacks, learning_rate=lambda s: 0.1 * (s + 1),
                    voxels_for_step=lambda step: 1000,
                    input_error=lambda: None)


def test_the_loop_steps_from_the_start_step_and_calls_back_in_order():
    recorder = Recorder()
    state = _loop(LoopState(start_step=2, total_steps=5), [recorder], losses=[3.0, 2.0, 1.0])
    assert recorder.events == [("begin", 2), ("step", 3), ("step", 4), ("step", 5), ("end", 5)]
    assert (state.step, state.loss, state.dice, state.stop) == (5, 1.0, 0.5, None)
    assert state.row["step"] == 5 and state.row["lr"] == pytest.approx(0.5)  # lr of the step just taken
    assert set(state.row) == {"step", "loss", "dice", "lr", "voxels_per_s", "rss_bytes", "input_wait_s", "step_s"}


def test_metrics_every_k_steps_and_the_last(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    _loop(LoopState(0, 7), [cb.MetricsLog(run, log_every=3)])
    assert [r["step"] for r in read_jsonl(run.metrics)] == [3, 6, 7]


class FakeCheckpoints:
    def __init__(self):
        self.saved = []

    def save(self, step, model, optimizer, extra):
        self.saved.append(step)
        return f"ckpt-{step}"

    def latest(self):
        return f"ckpt-{self.saved[-1]}" if self.saved else None


def test_the_non_finite_guard_stops_before_the_step_is_recorded_or_saved(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    saves = FakeCheckpoints()
    callbacks = [cb.NonFiniteGuard(saves), cb.MetricsLog(run, 1), cb.Checkpoints(saves, 2, None, None)]
    with pytest.raises(TrainingError, match=r"^Loss is nan at step 3: training stopped; the newest good checkpoint "
                                            r"is ckpt-2\. Try a lower --lr or --precision fp32\.$"):
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


def test_an_input_failure_is_the_readers_own_error():
    import tensorflow as tf

    def failing():
        raise tf.errors.UnknownError(None, None, "reader died")
        yield  # pragma: no cover

    own = TrainingError("Case 'x': unreadable")
    with pytest.raises(TrainingError, match="^Case 'x': unreadable$"):
        run_loop(LoopState(0, 3), _losses([1.0]), failing(), [], learning_rate=lambda s: 0.1,
                 voxels_for_step=lambda step: 1,
                 input_error=lambda: own)
    with pytest.raises(TrainingError, match="^The input pipeline failed: reader died$"):
        run_loop(LoopState(0, 3), _losses([1.0]), failing(), [], learning_rate=lambda s: 0.1,
                 voxels_for_step=lambda step: 1,
                 input_error=lambda: None)


def test_contexts_are_held_for_the_whole_loop_and_closed_on_error():
    events = []

    class Held(Callback):
        def context(self):
            class Context:
                def __enter__(self):
                    events.append("enter")

                def __exit__(self, *exc):
                    events.append("exit")

            return Context()

        def on_step_end(self, state):
            events.append(state.step)
            if state.step == 2:
                raise TrainingError("boom")

    with pytest.raises(TrainingError):
        _loop(LoopState(0, 5), [Held()])
    assert events == ["enter", 1, 2, "exit"]
