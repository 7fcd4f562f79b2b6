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
from bigmem.monitor.events import EventWriters
from bigmem.rundir import RunDir
from bigmem.checkpoints import CheckpointManager
from bigmem.train.loop import Callback, LoopState, StopReason
from bigmem.train.progress import TrainProgress
from bigmem.train.resume import checkpoint_state


class NonFiniteGuard(Callback):
    """Stops the run at a NaN/Inf loss, before the step is recorded or checkpointed.

    Raises:
        TrainingError: naming the step and the newest good checkpoint.
    """

    def __init__(self, checkpoints: CheckpointManager):
        self.checkpoints = checkpoints

    def on_step_end(self, state: LoopState) -> None:
        """Raise at a non-finite loss (before later callbacks record the step)."""
        if math.isfinite(state.loss):
            return
        kept = self.checkpoints.latest()
        where = f"the newest good checkpoint is {kept}" if kept else "no checkpoint was written yet"
        raise TrainingError(f"Loss is {state.loss} at step {state.step}: training stopped; {where}. "
                            "Try a lower {train.lr} or {train.precision} fp32.")


class MetricsLog(Callback):
    """Appends every ``log_every``-th step's row (and the last) to metrics.jsonl."""

    def __init__(self, run: RunDir, log_every: int):
        self.run, self.log_every = run, log_every

    def on_step_end(self, state: LoopState) -> None:
        """Append the step's row on every ``log_every``-th step and the last."""
        if state.step % self.log_every == 0 or state.step == state.total_steps:
            self.run.append_metrics([state.row])


class Progress(Callback):
    """The progress bar (a terminal) or ~20 plain lines (a log)."""

    def __init__(self, console: Console, total_steps: int, start_step: int):
        self.bar = TrainProgress(console, total_steps, start_step)

    def context(self):
        """The progress display, open for the whole loop."""
        return self.bar

    def on_step_end(self, state: LoopState) -> None:
        """Show the step's row."""
        self.bar.update(state.row)


class Checkpoints(Callback):
    """Saves model, optimizer and step every ``every`` steps, at the last step, and when stopped early."""

    def __init__(self, checkpoints: CheckpointManager, every: int, model, optimizer):
        self.checkpoints, self.every = checkpoints, every
        self.model, self.optimizer = model, optimizer
        self.saved_step: int | None = None

    def save(self, state: LoopState):
        """Write the checkpoint of ``state.step``; returns its path."""
        self.saved_step = state.step
        return self.checkpoints.save(state.step, self.model, self.optimizer, checkpoint_state(state))

    def on_step_end(self, state: LoopState) -> None:
        """Save every ``every`` steps and at the last step."""
        if state.step % self.every == 0 or state.step == state.total_steps:
            self.save(state)

    def on_train_end(self, state: LoopState) -> None:
        """Save the step a stopped run ended at, unless it was just saved."""
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
        """SIGINT/SIGTERM handlers, installed for the loop and then restored."""
        return self.signals

    def on_step_end(self, state: LoopState) -> None:
        """Stop after this step if a signal came."""
        if self.signals.signum is not None:
            state.stop, state.interrupted_by = StopReason.SIGNAL, self.signals.signum


class TimeBudget(Callback):
    """Ends the run once ``budget_s`` seconds of this session's training have passed (``--time-budget``).

    Training is the session's time less what callbacks spent on other work (``LoopState.excluded_s``:
    validation), so two runs given one budget train for the same time however they validate.
    """

    def __init__(self, budget_s: float, clock=time.monotonic):
        self.budget_s, self.clock = budget_s, clock
        self.started_s = clock()

    def on_train_begin(self, state: LoopState) -> None:
        """Start the clock (a zero budget stops before the first step)."""
        self.started_s = self.clock()
        if self.budget_s <= 0:
            state.stop = StopReason.TIME_BUDGET

    def on_step_end(self, state: LoopState) -> None:
        """Stop once the budget has passed."""
        if self.clock() - self.started_s - state.excluded_s >= self.budget_s:
            state.stop = StopReason.TIME_BUDGET


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
        """The per-node peak sampler, running for the whole loop."""
        return self.sampler

    def write(self) -> dict:
        """Write numa.json as observed now (the peaks include a read made now); returns the report."""
        from bigmem.numa.observe import observed

        self.sampler.sample()
        report = observed(self.requested, self.sampler)
        self.run.write_numa(report)
        return report

    def on_step_end(self, state: LoopState) -> None:
        """Rewrite numa.json after the first step and when the run stops."""
        if state.step == state.start_step + 1 or state.stop is not None:
            self.write()


class Monitor(Callback):
    """monitor.csv: CPU, memory, page cache, disk, NUMA nodes and GPUs every ``interval_s``."""

    def __init__(self, run: RunDir, interval_s: float, store_path: str | None):
        from bigmem.monitor.sampler import ResourceMonitor

        self.monitor = ResourceMonitor(run.monitor, interval_s=interval_s, store_path=store_path)

    def context(self):
        """The resource monitor's sampling thread, running for the whole loop."""
        return self.monitor


class Validation(Callback):
    """Every ``every`` steps and at the last: the held-out cases' Dice through the prediction path.

    ``val_dice`` (the foreground mean) and ``val_dice_per_class`` (and ``val_dice_per_region``, where
    the store defines regions) join the step's metrics row; a better ``val_dice`` than any before
    (a resumed run remembers it) replaces ``checkpoints/best``. A run ended by its time budget is
    validated once more at its last step.
    The cases go through the network as the run's model is used (``infer.validate``: whole
    volumes, or sliding windows of the patch a run on patches trained on); the time it takes is
    left out of the time budget (``LoopState.excluded_s``).
    """

    def __init__(self, every: int, predictor, store_path: str, case_ids: list[str],
                 checkpoints: CheckpointManager, console: Console, clock=time.monotonic):
        self.every, self.predictor, self.store_path, self.case_ids = every, predictor, store_path, case_ids
        self.checkpoints, self.console = checkpoints, console
        self.clock = clock
        self.last: dict | None = None
        self.validated_step: int | None = None
        kept = checkpoints.best
        state = checkpoints.read_state(kept) if kept else {}
        self.best_dice = float(state.get("val_dice", -math.inf))
        self.best_step = state.get("step")
        self.warned: set[str] = set()

    def _warn(self, message: str) -> None:
        """Print a validation warning the first time it comes (every validation would repeat it)."""
        if message not in self.warned:
            self.warned.add(message)
            self.console.print(f"warning: {message}", style="yellow", highlight=False)

    def _validate(self, state: LoopState) -> dict:
        from bigmem.infer.validate import validate

        started = self.clock()
        result = validate(self.predictor, self.store_path, self.case_ids, warn=self._warn)
        self.last, self.validated_step = result, state.step
        dice = result["val_dice"]
        if math.isfinite(dice) and dice > self.best_dice:
            self.best_dice, self.best_step = dice, state.step
            self.checkpoints.save_best(state.step, self.predictor.model, dict(result))
        per_class = ", ".join(f"{c}: {d:.3f}" for c, d in {**result["val_dice_per_class"],
                                                            **result.get("val_dice_per_region", {})}.items())
        self.console.print(f"validation at step {state.step}: Dice {dice:.3f} ({per_class}); best {self.best_dice:.3f} "
                           f"at step {self.best_step}", highlight=False)
        state.excluded_s += self.clock() - started
        return result

    def on_step_end(self, state: LoopState) -> None:
        """Validate every ``every`` steps and at the last; add the result to the row."""
        if state.step % self.every == 0 or state.step == state.total_steps:
            state.row.update(self._validate(state))

    def on_train_end(self, state: LoopState) -> None:
        """Validate the last step of a run its time budget ended."""
        if state.stop is StopReason.TIME_BUDGET and self.validated_step != state.step:
            self._validate(state)

    def summary(self) -> dict:
        """summary.json's validation fields."""
        if self.last is None:
            return {}
        return {**self.last, "best_val_dice": self.best_dice if self.best_step is not None else None,
                "best_step": self.best_step}


class ShapeStats(Callback):
    """The compiled step across shapes: traces, the seconds they cost, steps per shape, padding per epoch.

    A step at a shape not seen before traces and compiles the step function (TF and oneDNN keep a
    graph and primitives per shape). Its extra time is the first step's at that shape less the
    median of the later ones (where there are later ones); the run reports the sum.

    Args:
        console: where the closing line goes.
        traces: a zero-argument function, the step function's trace count so far.
        padding_share: ``epoch -> share of padded voxels`` (``VolumeLoader.padding_share``).
        steps_per_epoch: steps of one epoch.
    """

    def __init__(self, console: Console, traces, padding_share, steps_per_epoch: int):
        self.console, self.traces, self.padding_share = console, traces, padding_share
        self.steps_per_epoch = max(1, int(steps_per_epoch))
        self.first_s: dict[tuple, float] = {}
        self.later_s: dict[tuple, list[float]] = {}
        self.epochs: dict[int, float] = {}

    def on_step_end(self, state: LoopState) -> None:
        """Record the step's time under its shape, and each epoch's padding share."""
        shape = tuple(state.row.get("shape") or ())
        if shape in self.first_s:
            self.later_s[shape].append(state.row["step_s"])
        else:
            self.first_s[shape], self.later_s[shape] = state.row["step_s"], []
        epoch = (state.step - 1) // self.steps_per_epoch
        if epoch not in self.epochs:
            self.epochs[epoch] = self.padding_share(epoch)

    @property
    def compile_s(self) -> float:
        """Seconds the first step at each shape took beyond that shape's median step."""
        total = 0.0
        for shape, first in self.first_s.items():
            later = sorted(self.later_s[shape])
            if later:
                total += max(0.0, first - later[len(later) // 2])
        return total

    def on_train_end(self, state: LoopState) -> None:
        """Print one line when the step ran at more than one shape."""
        if len(self.first_s) > 1:
            self.console.print(f"Compiled the step {self.traces()} times for {len(self.first_s)} shapes "
                               f"({self.compile_s:.1f} s beyond their later steps); padding "
                               + ", ".join(f"{100 * share:.1f}%" for share in self.epochs.values()) + " per epoch.")

    def summary(self) -> dict:
        """summary.json's fields: traces, compile_s, steps_per_shape, padding_share_per_epoch."""
        return {"traces": int(self.traces()), "compile_s": round(self.compile_s, 3),
                "steps_per_shape": {"x".join(map(str, shape)): 1 + len(self.later_s[shape]) for shape in self.first_s},
                "padding_share_per_epoch": [round(self.epochs[e], 6) for e in sorted(self.epochs)]}


class TensorBoard(Callback):
    """TensorBoard event files: train/ (loss, dice, lr, voxels/s per logged step) and validation/ (Dice).

    Written through ``monitor.events.EventWriters``: a run stopped by a full disk leaves no event file of its own.
    """

    def __init__(self, directory, log_every: int):
        self.events, self.log_every = EventWriters(directory), log_every

    def context(self):
        """Closes (flushes) the event writers when the loop ends (removes them if a full disk stopped it)."""
        return self.events

    def on_step_end(self, state: LoopState) -> None:
        """Write the logged step's training scalars and any validation Dice."""
        import tensorflow as tf

        row = state.row
        if state.step % self.log_every == 0 or state.step == state.total_steps:
            with self.events.writing("train", state.step):
                for name in ("loss", "dice", "lr", "voxels_per_s"):
                    tf.summary.scalar(name, row[name])
        if "val_dice" in row:
            with self.events.writing("validation", state.step):
                tf.summary.scalar("dice", row["val_dice"])
                for label, dice in row["val_dice_per_class"].items():
                    tf.summary.scalar(f"dice/class_{label}", dice)
                for region, dice in row.get("val_dice_per_region", {}).items():
                    tf.summary.scalar(f"dice/region_{region}", dice)
