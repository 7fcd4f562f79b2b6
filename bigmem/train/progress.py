"""The live progress line of ``bigmem train`` (rich on a terminal, plain lines otherwise)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from bigmem.units import format_bytes


def _describe(row: dict) -> str:
    return (f"loss {row['loss']:.4f}  dice {row['dice']:.3f}  {row['voxels_per_s'] / 1e6:.2f} Mvox/s  "
            f"RSS {format_bytes(row['rss_bytes'])}")


class TrainProgress:
    """Shows step, loss, Dice, voxels/s, RSS and ETA; prints ~20 plain lines when not a terminal."""

    def __init__(self, console: Console, total_steps: int, start_step: int):
        self.console = console
        self.total_steps = total_steps
        self.start_step = start_step
        self.live = console.is_terminal
        self.every = max(1, (total_steps - start_step) // 20)
        self._started = time.monotonic()
        self._progress = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(), console=console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")

    def __enter__(self) -> "TrainProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, row: dict) -> None:
        step = row["step"]
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=_describe(row))
        elif (step - self.start_step) % self.every == 0 or step == self.total_steps:
            done = step - self.start_step
            rate = done / max(time.monotonic() - self._started, 1e-9)
            eta = (self.total_steps - step) / rate if rate > 0 else float("nan")
            self.console.print(f"step {step}/{self.total_steps}  {_describe(row)}  ETA {eta:.0f} s",
                               highlight=False)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
