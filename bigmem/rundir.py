"""The run directory contract (docs/rundir.md): its files, their names, and their readers.

Every file is written through ``bigmem.atomic`` (whole, or not at all).
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Iterable

from bigmem.atomic import atomic_write_json, atomic_write_text, disk_errno, disk_full_error


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON-object lines of ``path`` (a torn last line, from a kill, and lines that are not
    UTF-8 JSON objects are skipped; ``read_jsonl_checked`` says which); [] when it does not exist."""
    return read_jsonl_checked(path)[0]


def read_jsonl_checked(path: str | os.PathLike,
                       keep: Callable[[dict[str, Any]], bool] | None = None) -> tuple[list[dict[str, Any]], list[int]]:
    """The JSON-object lines of ``path``, and the numbers (1-based) of the lines that are not.

    A line that is not UTF-8, not JSON, not an object, or an object ``keep`` refuses, is left
    out and its number returned; a last line without its newline that does not parse (a run
    killed mid-write, or writing now) is left out silently. Blank lines are ignored.

    Args:
        path: a JSON-lines file (metrics.jsonl).
        keep: which objects are rows (default: every object).

    Returns:
        (rows, other line numbers); ([], []) when ``path`` does not exist.

    Example:
        >>> rows, bad = read_jsonl_checked("runs/small-1/metrics.jsonl")
        >>> bad  # [] for a file bigmem wrote
        []
    """
    path = Path(path)
    if not path.exists():
        return [], []
    lines = path.read_bytes().split(b"\n")
    torn = len(lines) if lines[-1].strip() else None  # no newline after the last line: being written
    # (a torn line that happens to parse, such as a number cut short, is still not an object)
    rows, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            row = None
        if isinstance(row, dict) and (keep is None or keep(row)):
            rows.append(row)
        elif number != torn:
            bad.append(number)
    return rows, bad


class RunDir:
    """The files of one run directory, and the one place that names them.

    ======================  ==================================================================
    config.json             the resolved ExperimentConfig, with total_steps and effective_lr
    sysinfo.json            the machine: CPU, ISA, NUMA nodes, TensorFlow, oneDNN
    plan.json               the memory pre-flight: budget, predicted peak, chosen mode
    numa.json               the placement requested and what was observed (threads, pages)
    metrics.jsonl           one JSON row per logged step (appended; a kill tears the last line)
    monitor.csv             resource samples (``ResourceMonitor``), described by monitor.json
    summary.json            written once, when the run ends (its presence means "finished")
    checkpoints/            ``CheckpointManager``'s atomic checkpoints (and ``best``, with validation)
    tensorboard/            TensorBoard event files: train/ and validation/ scalars
    model.keras             the final model
    preprocessing.json      what the model expects of a scan (``infer.modelcard``): predict needs no store
    splits_final.json       with ``--fold K``: the cross-validation folds the run's fold was taken from
    report/                 ``bigmem report``'s default output folder
    ======================  ==================================================================

    JSON files are written whole under a temporary name and renamed into place, so a reader
    (``bigmem report`` on a running run) sees the old file or the new one, never half of one.

    Args:
        path: the run directory (created by the first write).

    Example:
        >>> run = RunDir("runs/small-1")
        >>> run.read_summary() is None  # not finished (or not started)
        True
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def sysinfo(self) -> Path:
        return self.path / "sysinfo.json"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def numa(self) -> Path:
        return self.path / "numa.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def monitor(self) -> Path:
        return self.path / "monitor.csv"

    @property
    def monitor_info(self) -> Path:
        """monitor.json: ``ResourceMonitor`` writes it beside its CSV, under the CSV's stem."""
        return self.monitor.with_suffix(".json")

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def model(self) -> Path:
        return self.path / "model.keras"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def splits(self) -> Path:
        """splits_final.json: nnU-Net v2's name and format for the folds (``data.splits``)."""
        return self.path / "splits_final.json"

    def holds_run(self) -> bool:
        return self.config.exists() or self.checkpoints.exists()

    # ---- writers (atomic) ---------------------------------------------------------------------

    def write_config(self, config: dict[str, Any]) -> Path:
        return atomic_write_json(self.config, config)

    def write_sysinfo(self, sysinfo: dict[str, Any]) -> Path:
        return atomic_write_json(self.sysinfo, sysinfo)

    def write_plan(self, plan: dict[str, Any]) -> Path:
        return atomic_write_json(self.plan, plan)

    def write_splits(self, splits: list[dict[str, list[str]]]) -> Path:
        """splits_final.json: a list of ``{"train": [case ids], "val": [case ids]}``, one per fold."""
        return atomic_write_json(self.splits, splits)

    def write_numa(self, report: dict[str, Any]) -> Path:
        """numa.json: ``bigmem.numa.observe.observed``'s report."""
        return atomic_write_json(self.numa, report)

    def write_summary(self, *, steps: int, train_s: float, peak_rss_bytes: int, loss: float, dice: float,
                      input_wait_s: float, step_time_s: float, input_stall_share: float,
                      validation: dict[str, Any] | None = None, shapes: dict[str, Any] | None = None) -> Path:
        """summary.json, the last file a run writes.

        Args:
            steps: the step the run ended at.
            train_s: wall seconds of this session's training loop.
            peak_rss_bytes: the process's VmHWM.
            loss: the last step's loss.
            dice: the last step's mean foreground Dice.
            input_wait_s: seconds this session's steps waited for their batch.
            step_time_s: seconds of this session's whole steps, waits included.
            input_stall_share: ``input_wait_s / step_time_s`` (0 without steps).
            validation: with ``--val-every``: the final ``val_dice`` and ``val_dice_per_class`` and
                the best (``best_val_dice``, ``best_step``), merged in.
            shapes: the compiled step's shapes (``traces``, ``compile_s``, ``steps_per_shape``,
                ``padding_share_per_epoch``), merged in.
        """
        return atomic_write_json(self.summary, {"steps": steps, "train_s": train_s, "peak_rss_bytes": peak_rss_bytes,
                                                "loss": loss, "dice": dice, "input_wait_s": input_wait_s,
                                                "step_time_s": step_time_s, "input_stall_share": input_stall_share,
                                                **(validation or {}), **(shapes or {})})

    def truncate_metrics(self, last_step: int) -> None:
        """Keep only the metric rows up to ``last_step`` (the step a resumed run restarts from)."""
        rows = [r for r in read_jsonl(self.metrics) if r.get("step", 0) <= last_step]
        atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in rows))

    def append_metrics(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append ``rows`` to metrics.jsonl, whole lines or none (a failed append is cut back off).

        Raises:
            DiskFullError: the filesystem is full or failing.
        """
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        size = self.metrics.stat().st_size if self.metrics.exists() else 0
        try:
            with open(self.metrics, "ab") as handle:
                handle.write(data)
        except OSError as exc:
            with suppress(OSError):
                os.truncate(self.metrics, size)  # no torn line left behind
            code = disk_errno(exc)
            if code is None:
                raise
            raise disk_full_error(self.metrics, len(data), code=code) from exc

    # ---- readers: None while a file does not exist; json.JSONDecodeError if it is not JSON ----

    def read_config(self) -> dict[str, Any] | None:
        return _read_json(self.config)

    def read_plan(self) -> dict[str, Any] | None:
        return _read_json(self.plan)

    def read_numa(self) -> dict[str, Any] | None:
        return _read_json(self.numa)

    def read_summary(self) -> dict[str, Any] | None:
        return _read_json(self.summary)

    def read_monitor_info(self) -> dict[str, Any] | None:
        return _read_json(self.monitor_info)

    def read_metrics(self) -> list[dict[str, Any]]:
        """The complete rows of metrics.jsonl (``read_jsonl``); [] before the first logged step."""
        return read_jsonl(self.metrics)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None
