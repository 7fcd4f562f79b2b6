"""The process that trains one of ``bigmem compare``'s runs and returns its figures.

Run as ``python -m bigmem.compare.runner REQUEST.json`` by ``compare.run`` through the one child
protocol (``bigmem.child``); prints one JSON line, a ``TrainingRun``. Each run has a process of its
own: its peak memory is its own, and the data-parallel path's logical CPU devices, which
TensorFlow sets up once per process, never meet the whole-volume path.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Mapping

from bigmem.child import serve
from bigmem.compare.report import CurvePoint, TrainingRun
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import TrainingError, UsageError
from bigmem.rundir import RunDir

MODULE = "bigmem.compare.runner"
# train's length is steps (or epochs); a run that is to stop at its time budget alone needs a step
# count that budget always reaches first. The learning-rate schedule decays over it, so after the
# warmup these runs train at the peak rate, as compare's runs always have.
STEPS_UNTIL_TIME_BUDGET = 10**7


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """One training run of a path, as its child process receives it.

    Attributes:
        config: the path's job: model, data, batch, seed, held-out cases, validation cadence,
            strategy and memory budget; its train length and checkpoint cadence are this request's.
        run_dir: the run directory (created).
        steps: steps to train; None: until ``time_budget_s``.
        time_budget_s: seconds of training to stop at (validation not counted); None: ``steps``.
        periodic_checkpoints: False (default; compare's runs are never resumed): the one checkpoint is
            the one train writes where the run ends; True: also every ``config.train.checkpoint_every`` steps.

    Example:
        >>> request = RunRequest(config, "cmp/cpu_bigmem/seed-0", steps=20, time_budget_s=None)
        >>> request.training_config().train.checkpoint_every
        20
    """

    config: ExperimentConfig
    run_dir: str
    steps: int | None
    time_budget_s: float | None
    periodic_checkpoints: bool = False

    def training_config(self) -> ExperimentConfig:
        """``config`` with this request's length and checkpoint cadence: the config ``train`` runs.

        Raises:
            UsageError: neither ``steps`` nor ``time_budget_s`` is given.
        """
        if self.steps is None and self.time_budget_s is None:
            raise UsageError("A compare run needs steps or a time budget: got neither.")
        steps = self.steps if self.steps is not None else STEPS_UNTIL_TIME_BUDGET
        # train checkpoints every checkpoint_every steps and always where a run ends (its last step
        # or an early stop): a cadence of the whole length leaves only that one.
        every = self.config.train.checkpoint_every if self.periodic_checkpoints else steps
        return self.config.updated({"train": {"steps": steps, "epochs": None, "time_budget_s": self.time_budget_s,
                                              "checkpoint_every": every}})

    def to_dict(self) -> dict[str, Any]:
        """The request as JSON-able data (the config as config.json's sections)."""
        return {"config": self.config.to_dict(), "run_dir": self.run_dir, "steps": self.steps,
                "time_budget_s": self.time_budget_s, "periodic_checkpoints": self.periodic_checkpoints}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunRequest:
        """The request ``to_dict`` wrote."""
        return cls(ExperimentConfig.from_dict(values["config"], source="compare request"), values["run_dir"],
                   values["steps"], values["time_budget_s"], bool(values.get("periodic_checkpoints", False)))


def summarize(run_dir: str | Path) -> TrainingRun:
    """A finished run's figures from its metrics.jsonl and summary.json.

    Args:
        run_dir: the run directory.

    Returns:
        ``TrainingRun``: training seconds are the sum of the steps' (validation not counted);
        ``step_s`` and ``voxels_per_s`` are medians without the first step, which includes tracing.
    """
    import numpy as np  # not at import: the child imports this module before the NUMA placement applies

    run = RunDir(run_dir)
    metrics, summary = run.read_metrics(), run.read_summary()
    steady = metrics[1:] or metrics
    elapsed = np.cumsum([row["step_s"] for row in metrics])
    curve = tuple(CurvePoint(row["step"], float(time_s), row["dice"], row.get("val_dice"))
                  for row, time_s in zip(metrics, elapsed))
    return TrainingRun(str(run_dir), summary["steps"], float(elapsed[-1]),
                       float(np.median([row["step_s"] for row in steady])),
                       float(np.median([row["voxels_per_s"] for row in steady])), summary["peak_rss_bytes"],
                       summary["dice"], curve)


def train_run(values: dict[str, Any]) -> dict[str, Any]:
    """Train the ``RunRequest`` of ``values`` with ``bigmem.train``'s Python API; its ``TrainingRun`` as a dict.

    Args:
        values: ``RunRequest.to_dict()``.

    Returns:
        ``summarize(run_dir).to_dict()``.

    Raises:
        TrainingError: a signal stopped the run before its end (and what ``train`` raises).
    """
    request = RunRequest.from_dict(values)
    config = request.training_config()
    from bigmem.numa.apply import place

    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow or numpy start threads
    from rich.console import Console

    from bigmem.train.trainer import train

    # train's progress goes to stderr: stdout carries the one result line, and a failure's last
    # stderr line (what the parent reports) is the error itself
    result = train(config, request.run_dir, console=Console(file=sys.stderr, soft_wrap=True))
    if result.interrupted_by is not None:
        raise TrainingError(f"Stopped by signal {result.interrupted_by} at step {result.final_step} of "
                            f"{result.total_steps}: a compare run is not resumed; run compare again.")
    return summarize(request.run_dir).to_dict()


def main(argv: list[str] | None = None) -> int:
    """``python -m bigmem.compare.runner REQUEST.json``: ``train_run``'s result as one JSON line (``child.serve``)."""
    return serve(train_run, argv)


if __name__ == "__main__":
    sys.exit(main())
