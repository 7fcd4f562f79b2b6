"""What a training run does besides stepping, one callback each (``train/loop.py`` calls them).

Their order matters and is ``default_callbacks``'s: the non-finite guard runs before anything
records the step; checkpoints are written after the metrics they cover; stopping (signal, time
budget) is decided after the step's checkpoint.
"""

from __future__ import annotations

import math
import signal
import threading
import time

from rich.console import Console

from bigmem.errors import TrainingError
from bigmem.rundir import RunDir
from bigmem.checkpoints import CheckpointManager
from bigmem.train.loop import Callback, LoopState
from bigmem.train.progress import TrainProgress


class NonFiniteGuard(Callback):
    """Stops the run at a NaN/Inf loss, before the step is recorded or checkpointed.

    Raises:
        TrainingError: naming the step and the newest good checkpoint.
    """

    def __init__(self, checkpoints: CheckpointManager):
        self.checkpoints = checkpoints

    def on_step_end(self, state: LoopState) -> None:
        if math.isfinite(state.loss):
            return
        kept = self.checkpoints.latest()
        where = f"the newest good checkpoint is {kept}" if kept else "no checkpoint was written yet"
        raise TrainingError(f"Loss is {state.loss} at step {state.step}: training stopped; {where}. "
                            "Try a lower --lr or --precision fp32.")


class MetricsLog(Callback):
    """Appends every ``log_every``-th step's row (and the last) to metrics.jsonl."""

    def __init__(self, run: RunDir, log_every: int):
        self.run, self.log_every = run, log_every

    def on_step_end(self, state: LoopState) -> None:
        if state.step % self.log_every == 0 or state.step == state.total_steps:
            self.run.append_metrics([state.row])


class Progress(Callback):
    """The progress bar (a terminal) or ~20 plain lines (a log)."""

    def __init__(self, console: Console, total_steps: int, start_step: int):
        self.bar = TrainProgress(console, total_steps, start_step)

    def context(self):
        return self.bar

    def on_step_end(self, state: LoopState) -> None:
        self.bar.update(state.row)


class Checkpoints(Callback):
    """Saves model, optimizer and step every ``every`` steps, at the last step, and when stopped early."""

    def __init__(self, checkpoints: CheckpointManager, every: int, model, optimizer):
        self.checkpoints, self.every = checkpoints, every
        self.model, self.optimizer = model, optimizer
        self.saved_step: int | None = None

    def save(self, state: LoopState):
        self.saved_step = state.step
        return self.checkpoints.save(state.step, self.model, self.optimizer,
                                     {"total_steps": state.total_steps, "loss": state.loss, "dice": state.dice})

    def on_step_end(self, state: LoopState) -> None:
        if state.step % self.every == 0 or state.step == state.total_steps:
            self.save(state)

    def on_train_end(self, state: LoopState) -> None:
        if state.stop is not None and self.saved_step != state.step:
            self.save(state)


class StopSignals:
    """Turns SIGINT/SIGTERM into a flag checked after each step (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopOnSignal(Callback):
    """SIGINT/SIGTERM end the run after the current step (then a checkpoint; ``--resume`` goes on)."""

    def __init__(self):
        self.signals = StopSignals()

    def context(self):
        return self.signals

    def on_step_end(self, state: LoopState) -> None:
        if self.signals.signum is not None:
            state.stop, state.interrupted_by = "signal", self.signals.signum


class TimeBudget(Callback):
    """Ends the run once ``budget_s`` seconds of this session have passed (``--time-budget``)."""

    def __init__(self, budget_s: float, clock=time.monotonic):
        self.budget_s, self.clock = budget_s, clock
        self.started_s = clock()

    def on_train_begin(self, state: LoopState) -> None:
        self.started_s = self.clock()
        if self.budget_s <= 0:
            state.stop = "time budget"

    def on_step_end(self, state: LoopState) -> None:
        if self.clock() - self.started_s >= self.budget_s:
            state.stop = "time budget"


class NUMAReport(Callback):
    """numa.json: the requested placement and what the threads and pages did.

    Written before the first step, again after it (TensorFlow's pools have run by then), when
    the run stops, and at the end with each node's peak resident bytes.
    """

    def __init__(self, run: RunDir, requested: dict):
        from bigmem.numa.observe import NodePeakSampler

        self.run, self.requested = run, requested
        self.sampler = NodePeakSampler()

    def context(self):
        return self.sampler

    def write(self) -> dict:
        from bigmem.numa.observe import observed

        report = observed(self.requested, self.sampler)
        self.run.write_numa(report)
        return report

    def on_step_end(self, state: LoopState) -> None:
        if state.step == state.start_step + 1 or state.stop is not None:
            self.write()


class Monitor(Callback):
    """monitor.csv: CPU, memory, page cache, disk, NUMA nodes and GPUs every ``interval_s``."""

    def __init__(self, run: RunDir, interval_s: float, store_path: str | None):
        from bigmem.monitor.sampler import ResourceMonitor

        self.monitor = ResourceMonitor(run.monitor, interval_s=interval_s, store_path=store_path)

    def context(self):
        return self.monitor
