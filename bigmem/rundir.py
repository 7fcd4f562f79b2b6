"""The run directory contract (DESIGN.md) and atomic file writes."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, flush it, and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a torn last line, from a kill, is skipped)."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class RunDir:
    """Paths of one run: config.json, plan.json, sysinfo.json, numa.json, metrics.jsonl,
    monitor.csv, summary.json, checkpoints/, model.keras."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def sysinfo(self) -> Path:
        return self.path / "sysinfo.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def monitor(self) -> Path:
        return self.path / "monitor.csv"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def model(self) -> Path:
        return self.path / "model.keras"

    def holds_run(self) -> bool:
        return self.config.exists() or self.checkpoints.exists()

    def truncate_metrics(self, last_step: int) -> None:
        """Keep only the metric rows up to ``last_step`` (the step a resumed run restarts from)."""
        rows = [r for r in read_jsonl(self.metrics) if r.get("step", 0) <= last_step]
        atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in rows))

    def append_metrics(self, rows: Iterable[dict[str, Any]]) -> None:
        with open(self.metrics, "a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
            handle.flush()
