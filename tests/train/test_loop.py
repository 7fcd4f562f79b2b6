"""The loop itself (order of calls, input failures, held contexts), without a model: a fake step and batches."""

from __future__ import annotations

import pytest

from bigmem.errors import TrainingError
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
    assert state.row["step"] == 5
    assert state.row["lr"] == pytest.approx(0.5)  # lr of the step just taken
    assert set(state.row) == {"step", "loss", "dice", "lr", "voxels_per_s", "rss_bytes", "input_wait_s", "step_s"}


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
