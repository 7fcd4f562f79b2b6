"""``bigmem report``: plots and a short summary of one run, or two side by side.

Reads what a run directory holds (metrics.jsonl, monitor.csv, summary.json, plan.json,
config.json), finished or still running, and writes PNGs (matplotlib, Agg) and report.md /
report.json to the output folder. Every file is written under a temporary name and renamed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bigmem.errors import DataError
from bigmem.atomic import atomic_output, atomic_write_json, atomic_write_text
from bigmem.rundir import RunDir, read_jsonl_checked
from bigmem.units import format_bytes

MIB = 2**20
PLOTS = ("loss_dice", "throughput", "memory", "cpu", "disk", "page_cache")


@dataclass
class RunData:
    """One run directory, read."""

    path: Path
    label: str
    metrics: list[dict]
    monitor: dict[str, list[float]] = field(default_factory=dict)
    summary: dict | None = None
    plan: dict | None = None
    config: dict | None = None
    monitor_info: dict | None = None  # monitor.json: the disk device and nodes the columns describe
    notes: list[str] = field(default_factory=list)  # what was left out while reading, one line each

    @property
    def finished(self) -> bool:
        """Whether the run wrote its summary.json."""
        return self.summary is not None

    def column(self, name: str) -> list[float]:
        """One monitor.csv column by name ([] when the run has no such column)."""
        return self.monitor.get(name, [])

    @property
    def node_columns(self) -> list[str]:
        """monitor.csv's per-NUMA-node columns (``node<N>_used_bytes``), by node number."""
        return sorted((c for c in self.monitor if c.startswith("node") and c.endswith("_used_bytes")),
                      key=lambda c: int(c[4:-len("_used_bytes")]))


# The fields every metrics.jsonl step row has (train/loop.py writes them); others are optional.
METRIC_FIELDS = ("step", "loss", "dice", "voxels_per_s", "step_s")


def _step_row(row) -> bool:
    """Whether ``row`` is a metrics.jsonl step row: an object with an integer step and numeric METRIC_FIELDS."""
    if not isinstance(row, dict):
        return False
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return False
    return all(isinstance(row.get(name), (int, float)) and not isinstance(row.get(name), bool)
               for name in METRIC_FIELDS[1:])


def read_metrics(path: Path) -> tuple[list[dict], list[int]]:
    """metrics.jsonl's step rows, and the numbers of the lines that are not step rows.

    Read by ``rundir.read_jsonl_checked``: a line that is not UTF-8, not JSON, not an object or
    lacks one of ``METRIC_FIELDS`` is left out and its number returned; a torn last line (a
    running or killed run) is left out silently.

    Returns:
        (rows, bad line numbers, 1-based); ([], []) when the file does not exist.
    """
    try:
        return read_jsonl_checked(path, keep=_step_row)
    except OSError as exc:
        raise DataError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None


def read_monitor(path: Path) -> dict[str, list[float]]:
    """monitor.csv as columns of floats; a torn last row (a running or killed run) is skipped.

    A file that is not monitor.csv (no ``time_s`` column, undecodable bytes, NUL bytes) or has no
    complete row reads as no columns ({}).
    """
    if not path.exists():
        return {}
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as handle:
            reader = csv.DictReader(handle)
            columns: dict[str, list[float]] = {name: [] for name in reader.fieldnames or ()}
            if "time_s" not in columns:
                return {}
            for row in reader:
                if None in row or None in row.values():
                    continue  # a torn row: fewer (or more) fields than the header
                try:
                    values = {k: float(v) if v != "" else math.nan for k, v in row.items()}
                except ValueError:
                    continue  # a torn last field
                for name, value in values.items():
                    columns[name].append(value)
    except csv.Error:  # NUL bytes, an unterminated quote: not a CSV bigmem wrote
        return {}
    return columns if columns["time_s"] else {}


def read_run(path: str | os.PathLike) -> RunData:
    """Read a run directory, finished or still running.

    Args:
        path: the run directory.

    Returns:
        Its ``RunData`` (files the run has not written yet are empty or None; lines of
        metrics.jsonl that are not step rows are left out and counted in ``notes``).

    Raises:
        DataError: no such directory; neither step rows in metrics.jsonl nor rows in monitor.csv
            (saying which file holds what instead); or a JSON file that does not parse or is not
            an object.
    """
    run = RunDir(path)
    if not run.path.is_dir():
        raise DataError(f"Cannot report on {str(path)!r}: no such directory.")
    metrics, bad = read_metrics(run.metrics)
    monitor = read_monitor(run.monitor)
    notes = []
    if bad:
        listed = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        notes.append(f"{run.metrics}: left out line {listed} (not a step row)" if len(bad) == 1 else
                     f"{run.metrics}: left out {len(bad)} lines that are not step rows (lines {listed})")
    if run.monitor.exists() and not monitor:
        notes.append(f"{run.monitor}: no readable rows (not a bigmem monitor.csv, or no sample yet); left out")
    if not metrics and not monitor:
        fields = ", ".join(METRIC_FIELDS[:-1]) + f" and {METRIC_FIELDS[-1]}"
        found = [f"metrics.jsonl has no step rows ({len(bad)} other line{'s' if len(bad) != 1 else ''}; a step row "
                 f"is a JSON object with {fields})" if run.metrics.exists() else "",
                 "monitor.csv has no readable rows (expected a time_s column and numeric rows)"
                 if run.monitor.exists() else ""]
        found = [f for f in found if f]
        if not found:
            raise DataError(f"Cannot report on {str(path)!r}: it has neither metrics.jsonl nor monitor.csv "
                            "(is it a bigmem run directory, and has its first step finished?).")
        raise DataError(f"Cannot report on {str(path)!r}: {' and '.join(found)}.")

    def load(read, file: Path) -> dict | None:
        try:
            value = read()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataError(f"Cannot report on {str(path)!r}: {file.name} is not valid JSON.") from None
        if value is not None and not isinstance(value, dict):
            raise DataError(f"Cannot report on {str(path)!r}: {file.name} is not a JSON object.")
        return value

    return RunData(run.path, run.path.name or str(run.path), metrics, monitor, load(run.read_summary, run.summary),
                   load(run.read_plan, run.plan), load(run.read_config, run.config),
                   load(run.read_monitor_info, run.monitor_info), notes)


def _max(values: list[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else None


def summarise(run: RunData) -> dict:
    """The figures report.md states, for one run."""
    steps = run.metrics[1:] or run.metrics  # the first step includes tracing
    step_s = sum(r.get("step_s", 0.0) for r in run.metrics)
    wait_s = sum(r.get("input_wait_s", 0.0) for r in run.metrics)
    peak_rss = _max(run.column("peak_rss_bytes") + run.column("rss_bytes"))
    predicted = (run.plan or {}).get("predicted_peak_bytes")
    reads = run.column("disk_read_bytes_per_s")
    writes = run.column("disk_write_bytes_per_s")
    validated = [r for r in run.metrics if r.get("val_dice") is not None and not math.isnan(r["val_dice"])]
    return {
        "run_dir": str(run.path),
        "state": "finished" if run.finished else "running or stopped",
        "steps": run.metrics[-1]["step"] if run.metrics else 0,
        "last_loss": run.metrics[-1]["loss"] if run.metrics else None,
        "last_dice": run.metrics[-1]["dice"] if run.metrics else None,
        "last_val_dice": validated[-1]["val_dice"] if validated else None,
        "best_val_dice": max((r["val_dice"] for r in validated), default=None),
        "median_voxels_per_s": statistics.median(r["voxels_per_s"] for r in steps) if steps else None,
        "median_step_s": statistics.median(r["step_s"] for r in steps) if steps else None,
        "input_stall_share": wait_s / step_s if step_s else None,
        "peak_rss_bytes": int(peak_rss) if peak_rss is not None else None,
        "predicted_peak_bytes": predicted,
        "peak_vs_plan": peak_rss / predicted if peak_rss and predicted else None,
        "mean_cpu_percent": _mean(run.column("cpu_percent")),
        "peak_cpu_percent": _max(run.column("cpu_percent")),
        "mean_disk_read_bytes_per_s": _mean(reads),
        "peak_disk_read_bytes_per_s": _max(reads),
        "mean_disk_write_bytes_per_s": _mean(writes),
        "peak_disk_write_bytes_per_s": _max(writes),
        "peak_page_cache_bytes": _max(run.column("page_cache_bytes")),
        "node_peak_used_bytes": {c[:-len("_used_bytes")]: _max(run.column(c)) for c in run.node_columns},
        "monitor_samples": len(run.column("time_s")),
        "disk_device": (run.monitor_info or {}).get("disk_device"),
        "notes": list(run.notes),
    }


# ---- plots ---------------------------------------------------------------------------------------

def _plot(path: Path, runs: list[RunData], draw, title: str, *, rows: int = 1, ylabels=(), xlabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows), squeeze=False, sharex=True)
    axes = [a[0] for a in axes]
    for run in runs:
        draw(axes, run)
    for axis, ylabel in zip(axes, ylabels):
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    axes[-1].set_xlabel(xlabel)
    axes[0].set_title(title)
    figure.tight_layout()
    try:
        with atomic_output(path) as tmp:
            figure.savefig(tmp, dpi=100)
    finally:
        plt.close(figure)
    return path


def _label(run: RunData, what: str, runs: list[RunData]) -> str:
    return what if len(runs) == 1 else f"{run.label}: {what}"


def _loss_dice(axes, run: RunData, runs: list[RunData]) -> None:
    steps = [r["step"] for r in run.metrics]
    axes[0].plot(steps, [r["loss"] for r in run.metrics], label=_label(run, "loss", runs))
    axes[1].plot(steps, [r["dice"] for r in run.metrics], label=_label(run, "Dice", runs))
    validated = [r for r in run.metrics if "val_dice" in r]
    if validated:  # --val-every: the held-out cases' Dice
        axes[1].plot([r["step"] for r in validated], [r["val_dice"] for r in validated], marker="o",
                     label=_label(run, "validation Dice", runs))


def _throughput(axes, run: RunData, runs: list[RunData]) -> None:
    axes[0].plot([r["step"] for r in run.metrics], [r["voxels_per_s"] / 1e6 for r in run.metrics],
                 label=_label(run, "voxels/s", runs))


def _memory(axes, run: RunData, runs: list[RunData]) -> None:
    t = run.column("time_s")
    axes[0].plot(t, [v / 2**30 for v in run.column("rss_bytes")], label=_label(run, "RSS", runs))
    for column in run.node_columns:
        axes[0].plot(t, [v / 2**30 for v in run.column(column)], linestyle="--",
                     label=_label(run, f"{column[:-len('_used_bytes')]} used (system)", runs))
    predicted = (run.plan or {}).get("predicted_peak_bytes")
    if predicted:
        axes[0].axhline(predicted / 2**30, color="grey", linestyle=":", label=_label(run, "planned peak", runs))


def _cpu(axes, run: RunData, runs: list[RunData]) -> None:
    axes[0].plot(run.column("time_s"), run.column("cpu_percent"), label=_label(run, "CPU", runs))


def _disk(axes, run: RunData, runs: list[RunData]) -> None:
    t = run.column("time_s")
    axes[0].plot(t, [v / MIB for v in run.column("disk_read_bytes_per_s")], label=_label(run, "read", runs))
    axes[0].plot(t, [v / MIB for v in run.column("disk_write_bytes_per_s")], label=_label(run, "write", runs))


def _page_cache(axes, run: RunData, runs: list[RunData]) -> None:
    axes[0].plot(run.column("time_s"), [v / 2**30 for v in run.column("page_cache_bytes")],
                 label=_label(run, "page cache", runs))


# Each plot: how a run is drawn on its axes, its title, rows of axes, their y labels and the x axis.
PLOT_SPECS = {
    "loss_dice": (_loss_dice, "Loss and Dice", 2, ("loss", "Dice"), "step"),
    "throughput": (_throughput, "Throughput", 1, ("Mvoxels/s",), "step"),
    "memory": (_memory, "Memory: process RSS, NUMA nodes, plan", 1, ("GiB",), "time (s)"),
    "cpu": (_cpu, "Process CPU (100% = one core busy)", 1, ("CPU %",), "time (s)"),
    "disk": (_disk, "Disk throughput of the store's device", 1, ("MiB/s",), "time (s)"),
    "page_cache": (_page_cache, "System page cache", 1, ("GiB",), "time (s)"),
}


def make_plots(runs: list[RunData], out: Path) -> dict[str, Path]:
    """Write one PNG per name in PLOTS to ``out``, the runs overlaid.

    Args:
        runs: one or two runs.
        out: an existing folder.

    Returns:
        ``{plot name: PNG path}``.
    """
    paths: dict[str, Path] = {}
    for name in PLOTS:
        draw, title, rows, ylabels, xlabel = PLOT_SPECS[name]
        paths[name] = _plot(out / f"{name}.png", runs, lambda axes, run, draw=draw: draw(axes, run, runs), title,
                            rows=rows, ylabels=ylabels, xlabel=xlabel)
    return paths


# ---- markdown ------------------------------------------------------------------------------------

def _bytes(value) -> str:
    return "-" if value is None else format_bytes(int(value))


def _rate(value) -> str:
    return "-" if value is None else f"{value / MIB:.1f} MiB/s"


def _num(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def markdown(summaries: list[dict], plots: dict[str, Path]) -> str:
    """report.md: a table with one column per run (``summarise``'s figures) and the plots.

    Args:
        summaries: ``summarise`` of each run.
        plots: ``make_plots``' result.

    Returns:
        The Markdown text.
    """
    heads = [Path(s["run_dir"]).name for s in summaries]
    lines = ["# bigmem report", "", "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]

    def row(name: str, render) -> None:
        lines.append(f"| {name} | " + " | ".join(render(s) for s in summaries) + " |")

    row("state", lambda s: s["state"])
    row("steps", lambda s: str(s["steps"]))
    row("last loss / Dice", lambda s: f"{_num(s['last_loss'], '.4f')} / {_num(s['last_dice'], '.3f')}")
    row("validation Dice last / best", lambda s: f"{_num(s['last_val_dice'], '.3f')} / "
                                                 f"{_num(s['best_val_dice'], '.3f')}")
    row("throughput (median)", lambda s: _num(s["median_voxels_per_s"] and s["median_voxels_per_s"] / 1e6, ".3f",
                                              " Mvoxels/s"))
    row("step time (median)", lambda s: _num(s["median_step_s"], ".3f", " s"))
    row("input stall share", lambda s: _num(s["input_stall_share"] and 100 * s["input_stall_share"], ".1f", "%"))
    row("peak RSS (monitor.csv)", lambda s: _bytes(s["peak_rss_bytes"]))
    row("planned peak (plan.json)", lambda s: _bytes(s["predicted_peak_bytes"]))
    row("peak / plan", lambda s: _num(s["peak_vs_plan"], ".2f", "x"))
    row("CPU mean / peak", lambda s: f"{_num(s['mean_cpu_percent'], '.0f', '%')} / "
                                     f"{_num(s['peak_cpu_percent'], '.0f', '%')}")
    row("disk device", lambda s: s["disk_device"] or "-")
    row("disk read mean / peak", lambda s: f"{_rate(s['mean_disk_read_bytes_per_s'])} / "
                                           f"{_rate(s['peak_disk_read_bytes_per_s'])}")
    row("disk write mean / peak", lambda s: f"{_rate(s['mean_disk_write_bytes_per_s'])} / "
                                            f"{_rate(s['peak_disk_write_bytes_per_s'])}")
    row("page cache peak", lambda s: _bytes(s["peak_page_cache_bytes"]))
    row("NUMA node peak used (system)", lambda s: ", ".join(f"{k} {_bytes(v)}" for k, v in
                                                            s["node_peak_used_bytes"].items()) or "-")
    row("monitor samples", lambda s: str(s["monitor_samples"]))
    if any(s["notes"] for s in summaries):
        row("left out while reading", lambda s: "; ".join(s["notes"]) or "-")
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({path.name})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def make_report(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """Write the plots, report.md and report.json for ``run_dirs`` (one or two) to ``out``.

    ``out`` defaults to ``<first run>/report``. Returns the folder and report.json's content.
    """
    if not 1 <= len(run_dirs) <= 2:
        raise DataError(f"bigmem report takes one or two run directories, got {len(run_dirs)}.")
    runs = [read_run(path) for path in run_dirs]
    if len(runs) == 2 and runs[0].label == runs[1].label:
        for run in runs:
            run.label = str(run.path)
    folder = Path(out) if out is not None else RunDir(runs[0].path).report
    folder.mkdir(parents=True, exist_ok=True)
    summaries = [summarise(run) for run in runs]
    plots = make_plots(runs, folder)
    atomic_write_text(folder / "report.md", markdown(summaries, plots))
    report = {"runs": summaries, "plots": {name: path.name for name, path in plots.items()}}
    atomic_write_json(folder / "report.json", report)
    return folder, report
