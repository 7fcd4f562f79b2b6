"""Per-machine calibration of the footprint estimate: an activation multiplier and a fixed overhead.

``bigmem profile --calibrate`` measures 2-3 small sizes in child processes and fits, per
(precision, recompute), ``measured - exact parts = framework_bytes + activation_scale * counted``
by least squares; the result is stored in the user's cache directory, keyed by CPU model,
TensorFlow version, precision and recompute mode. Without a stored fit the estimate uses the
defaults below and says so.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Sequence

from bigmem.data.synth import default_cache_dir
from bigmem.rundir import atomic_write_json

# Defaults, fitted by `bigmem profile --model small --batch-size 1 --precision P --recompute R
# --calibrate 32,64,96,128,160` for each (P, R), in a fresh cache, on the development machine:
# AMD EPYC (2 vCPUs, avx512_bf16, one NUMA node), TensorFlow 2.21.0, Keras 3.15.1, 2026-11-30.
# framework_bytes includes TensorFlow's own ~570 MiB resident after import.
DEFAULT_SOURCE = "default (fitted on the bigmem dev machine: AMD EPYC 2 vCPU, TF 2.21.0, small preset)"
DEFAULTS: dict[tuple[str, str], tuple[float, int]] = {
    ("fp32", "none"): (0.6404, 729_084_995),
    ("bf16", "none"): (1.003, 734_430_760),
    ("fp32", "stages"): (0.5385, 730_397_886),
    ("bf16", "stages"): (0.8223, 753_278_757),
}


@dataclass
class Calibration:
    activation_scale: float
    framework_bytes: int
    source: str
    key: dict = field(default_factory=dict)
    fitted_on: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_path() -> Path:
    return default_cache_dir() / "calibration.json"


def tensorflow_version() -> str:
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_key(precision: str, recompute: str) -> dict:
    return {"cpu": cpu_model(), "tensorflow": tensorflow_version(), "precision": precision, "recompute": recompute}


def _load_all(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("calibrations", [])
    except (OSError, ValueError):
        return []


def lookup_calibration(precision: str, recompute: str, *, path: Path | None = None) -> Calibration:
    """The stored calibration for this machine and mode, else the default."""
    key = machine_key(precision, recompute)
    for entry in _load_all(path or calibration_path()):
        if entry.get("key") == key:
            return Calibration(**entry)
    scale, framework = DEFAULTS[(precision, recompute)]
    return Calibration(scale, framework, DEFAULT_SOURCE, key)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys against xs (at least two distinct xs)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ValueError("calibration needs at least two different sizes")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return slope, mean_y - slope * mean_x


def fit_calibration(precision: str, recompute: str, points: Sequence[dict]) -> Calibration:
    """Fit from points {volume, counted_activation_bytes, exact_bytes, measured_peak_bytes}."""
    xs = [p["counted_activation_bytes"] for p in points]
    ys = [p["measured_peak_bytes"] - p["exact_bytes"] for p in points]
    scale, framework = fit_line(xs, ys)
    return Calibration(round(scale, 4), int(framework), f"this machine, fitted {time.strftime('%Y-%m-%d')}",
                       machine_key(precision, recompute), sorted(p["volume"] for p in points))


def save_calibration(calibration: Calibration, *, path: Path | None = None) -> Path:
    path = path or calibration_path()
    entries = [e for e in _load_all(path) if e.get("key") != calibration.key]
    entries.append(calibration.to_dict())
    return atomic_write_json(path, {"calibrations": entries})
