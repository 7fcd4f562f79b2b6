"""Where every benchmark writes its JSON: ``<out>/<kind>-<host>-<timestamp>.json``, atomically."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from bigmem.rundir import atomic_write_json


def write_results(kind: str, report: dict, out: str | Path, console=None) -> Path:
    """Write ``report`` keyed by machine and time; print where it went."""
    path = Path(out) / f"{kind}-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_json(path, report)
    if console is not None:
        console.print(f"wrote {path}")
    return path
