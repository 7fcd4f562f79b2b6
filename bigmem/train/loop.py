"""The training loop: a step, then the callbacks (Keras's ``fit`` loop is the model).

Everything a run does besides stepping (metrics, checkpoints, the NUMA report, the time budget,
the non-finite guard, progress, the resource monitor, signals) is a callback
(``train/callbacks.py``); a new feature is a new callback, not a branch here.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import psutil

from bigmem.errors import PeerLost, TrainingError


class StopReason(str, enum.Enum):
    """Why a callback stopped the loop before its last step (a string, for messages and summary.json)."""

    SIGNAL = "signal"  # Ctrl-C or SIGTERM: a checkpoint is written, and --resume continues
    TIME_BUDGET = "time budget"  # train.time_budget_s of training (validation not counted) is spent

    def __str__(self) -> str:  # "time budget" in messages, as in JSON (Python 3.11 prints the member's name)
        return self.value


@dataclass
class LoopState:
    """What the loop and its callbacks share.

    Attributes:
        step: the last completed step (the resume step before the first).
        start_step: the step this session started from.
        total_steps: the step the run ends at.
        loss, dice: the last step's loss and foreground Dice.
        row: the last step's metrics row (metrics.jsonl's fields).
        stop: why the loop stopped early (a ``StopReason``), or None.
        interrupted_by: the signal that stopped it, if any.
        waited_s, stepped_s: this session's input wait and whole step time (the stall share).
        excluded_s: this session's time in work that is not training (validation), which the
            time budget does not count.
    """

    start_step: int
    total_steps: int
    step: int = 0
    loss: float = float("nan")
    dice: float = float("nan")
    row: dict = field(default_factory=dict)
    stop: StopReason | None = None
    interrupted_by: int | None = None
    waited_s: float = 0.0
    stepped_s: float = 0.0
    excluded_s: float = 0.0
    started_s: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.step = self.start_step

    @property
    def done(self) -> bool:
        """Whether the loop ends now: the last step was reached or a callback stopped it."""
        return self.step >= self.total_steps or self.stop is not None


class Callback:
    """A hook into the loop; override what you need (all default to nothing)."""

    def context(self) -> contextlib.AbstractContextManager:
        """A context held for the whole loop (a progress bar, a sampler thread, signal handlers)."""
        return contextlib.nullcontext()

    def on_train_begin(self, state: LoopState) -> None:
        """Before the first step (``state.step`` is the start step)."""
        pass

    def on_step_end(self, state: LoopState) -> None:
        """After each step; ``state.row`` holds its metrics. May set ``state.stop`` or raise."""
        pass

    def on_train_end(self, state: LoopState) -> None:
        """After the last step, or after a callback stopped the loop (not after an exception)."""
        pass


def run_loop(state: LoopState, step: Callable, batches: Iterator, callbacks: Sequence[Callback], *,
             learning_rate: Callable[[int], float], voxels_for_step: Callable[[int], int],
             shape_for_step: Callable[[int], Sequence[int]] | None = None,
             input_error: Callable[[], Exception | None]) -> LoopState:
    """Step until ``state.total_steps`` or a callback sets ``state.stop``; callbacks after each step.

    Args:
        state: the loop's state (``start_step`` is where it resumes).
        step: ``step(images, labels) -> (loss, dice)``, compiled.
        batches: the input, one ``(images, labels)`` per step.
        callbacks: in order; a callback may stop the loop (``state.stop``) or raise.
        learning_rate: ``step -> lr`` of the schedule, for the metrics row.
        voxels_for_step: ``step -> voxels`` of scan (padding left out) the step fed, for the
            throughput column (``step`` from 0).
        shape_for_step: ``step -> (D, H, W)`` of the step's batch, for the row's ``shape``
            (default None: not recorded).
        input_error: the reader's own error, if the input pipeline failed (tf.data blurs it).

    Returns:
        ``state`` after the last step.

    Raises:
        TrainingError: the input pipeline failed; anything a callback raises.
    """
    process = psutil.Process()
    with contextlib.ExitStack() as stack:
        for callback in callbacks:
            stack.enter_context(callback.context())
        for callback in callbacks:
            callback.on_train_begin(state)
        while not state.done:
            started = time.perf_counter()
            images, labels = _next_batch(batches, input_error)
            fetched = time.perf_counter()
            loss, dice = _stepped(step, images, labels)
            state.loss, state.dice = float(loss), float(dice)
            elapsed = time.perf_counter() - started
            state.step += 1
            state.waited_s += fetched - started
            state.stepped_s += elapsed
            state.row = {"step": state.step, "loss": state.loss, "dice": state.dice,
                         "lr": float(learning_rate(state.step - 1)),
                         "voxels_per_s": voxels_for_step(state.step - 1) / elapsed,
                         "rss_bytes": process.memory_info().rss, "input_wait_s": fetched - started,
                         "step_s": elapsed}
            if shape_for_step is not None:
                state.row["shape"] = [int(s) for s in shape_for_step(state.step - 1)]
            for callback in callbacks:
                callback.on_step_end(state)
        for callback in callbacks:
            callback.on_train_end(state)
    return state


def _next_batch(batches: Iterator, input_error: Callable[[], Exception | None]):
    """The next ``(images, labels)``; a reader's error (it surfaces through tf.data) raised as the reader's own."""
    import tensorflow as tf

    try:
        return next(batches)
    except tf.errors.OpError as exc:
        if _collective_aborted(exc):  # a multi-worker input's collective, not the reader
            raise PeerLost() from None
        raise input_error() or TrainingError(f"The input pipeline failed: {exc.message}") from None


def _stepped(step: Callable, images, labels):
    """``step(images, labels)``; an aborted collective (another worker stopped) raised as ``PeerLost``."""
    import tensorflow as tf

    try:
        return step(images, labels)
    except tf.errors.OpError as exc:
        if _collective_aborted(exc):
            raise PeerLost() from None
        raise


COLLECTIVE_ABORTED = "Collective ops is aborted"  # TensorFlow's words when a peer worker is gone


def _collective_aborted(exc) -> bool:
    """Whether a TensorFlow error is a multi-worker collective aborted because a peer stopped."""
    return COLLECTIVE_ABORTED in (exc.message or "")
