"""What one real GPU measured, as ``bigmem compare --gpu-reference FILE`` uses it.

``compare`` runs its data-parallel path on logical CPU devices when this host has no GPU. The
file ``benchmarks/performance/gpu_reference.py`` writes on a machine that has one (PyTorch: such
machines may lack TensorFlow) measures the same architectures there: the GPU's memory, the
largest cubic patch each model trains at batch 2, and the step rate at the patches it timed. With
it, compare sizes the data-parallel path from measurement instead of the planner's allowance,
and its report says which figures are measured on a GPU and which are simulated.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from bigmem.errors import UsageError
from bigmem.units import format_bytes

SCHEMA = 1
MEASURED_BATCH = 2  # the script trains every patch at MLPerf's batch


@dataclasses.dataclass(frozen=True)
class StepRate:
    """One timed training point: ``steps_per_s`` at ``edge``^3 patches, ``batch`` per step."""

    edge: int
    batch: int
    steps_per_s: float
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class GpuReference:
    """One GPU's measurements for one model at one precision (``read_gpu_reference``).

    Attributes:
        file: the JSON it came from.
        gpu: the GPU's name ("NVIDIA H200").
        memory_bytes: its memory.
        torch: the PyTorch version that measured it.
        model: the preset measured.
        precision: "tf32" (float32 weights, TF32 convolutions) or "bf16" (autocast).
        largest_patch: the largest cube edge that trained at batch 2 (None: the file has no search).
        rates: the timed points, smallest patch first.
    """

    file: str
    gpu: str
    memory_bytes: int
    torch: str
    model: str
    precision: str
    largest_patch: int | None
    rates: tuple[StepRate, ...]

    def rate_for(self, edge: int) -> StepRate | None:
        """The timed point at ``edge``, else the largest timed (None: none)."""
        exact = [r for r in self.rates if r.edge == edge]
        return exact[0] if exact else (self.rates[-1] if self.rates else None)

    def measured_sentence(self, patch_edge: int | None) -> str:
        """What was measured on the GPU, in one sentence naming the file."""
        parts = [f"{self.gpu} ({format_bytes(self.memory_bytes)}), PyTorch {self.torch}, {self.model} {self.precision}"]
        if self.largest_patch:
            parts.append(f"largest patch at batch {MEASURED_BATCH} {self.largest_patch}^3")
        rate = self.rate_for(patch_edge) if patch_edge else None
        if rate:
            parts.append(f"on an {self.gpu} the patch path runs {rate.steps_per_s:.2f} steps/s per GPU "
                         f"at {rate.edge}^3 x {rate.batch}")
        return f"measured on a GPU ({self.file}): " + "; ".join(parts)

    @property
    def summary(self) -> str:
        """The report's cell: the step rate and the largest patch, or what the file lacked."""
        rate = self.rates[-1] if self.rates else None
        parts = [f"{self.gpu}, PyTorch {self.precision}"]
        parts.append(f"{rate.steps_per_s:.2f} steps/s per GPU at {rate.edge}^3 x {rate.batch}" if rate
                     else f"no {self.model} step timed")
        if self.largest_patch:
            parts.append(f"largest patch x {MEASURED_BATCH}: {self.largest_patch}^3")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """compare.json's ``gpu_reference``: the fields, ``rates`` as a list of dicts."""
        values = dataclasses.asdict(self)
        values["rates"] = [dataclasses.asdict(r) for r in self.rates]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GpuReference:
        """The reference ``to_dict`` wrote."""
        return cls(values["file"], values["gpu"], values["memory_bytes"], values["torch"], values["model"],
                   values["precision"], values["largest_patch"],
                   tuple(StepRate(**r) for r in values["rates"]))


def measured_precision(precision: str) -> str:
    """The script's name for a bigmem precision: fp32 trains as tf32 on a GPU (PyTorch's cuDNN default)."""
    return "tf32" if str(precision) == "fp32" else str(precision)


def load_gpu_reference(path: str | Path, *, flag: str = "{compare.gpu_reference}") -> dict[str, Any]:
    """The script's JSON at ``path``, checked to be a GPU's measurements.

    Raises:
        UsageError: the file is missing, not the script's JSON, or measured on a CPU (its ``--cpu`` check).
    """
    try:
        values = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot read it ({error.strerror or error}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{flag} {path}: not JSON ({error}): expected the file "
                         "benchmarks/performance/gpu_reference.py writes.") from None
    if not isinstance(values, dict) or values.get("schema") != SCHEMA or not isinstance(values.get("device"), dict):
        raise UsageError(f"{flag} {path}: not a gpu_reference.py result (schema {SCHEMA} with a device): "
                         "expected the file benchmarks/performance/gpu_reference.py writes.")
    if values["device"].get("kind") != "cuda":
        raise UsageError(f"{flag} {path}: measured on {values['device'].get('kind', 'an unknown device')}, not a "
                         "GPU: the script's CPU run checks its code and measures no GPU.")
    values["file"] = str(path)
    return values


def gpu_reference_for(values: Mapping[str, Any], model: str, precision: str, *,
                      memory_only: bool = False) -> GpuReference | None:
    """The measurements of ``model`` at ``precision`` (bigmem's: fp32 or bf16) in ``load_gpu_reference``'s
    ``values``. When the file did not search that model's largest patch: None, or with ``memory_only``
    the GPU and its memory with no patch and no rate."""
    wanted = measured_precision(precision)
    entries = [r for r in values.get("results", []) if r.get("model") == model and r.get("precision") == wanted
               and isinstance(r.get("largest_patch_batch2"), dict)]
    if not entries and not memory_only:
        return None
    entry = entries[0] if entries else {"largest_patch_batch2": {}}
    rates = sorted((StepRate(p["edge"], p["batch"], p["steps_per_s"], p["peak_bytes"])
                    for key, p in entry.items() if (key.startswith("mlperf_") or key == "planner_patch")
                    and isinstance(p, dict) and "steps_per_s" in p), key=lambda r: r.edge)
    device = values["device"]
    return GpuReference(values["file"], device["name"], device["memory_bytes"], values.get("torch", "?"), model,
                        wanted, entry["largest_patch_batch2"].get("largest_edge"), tuple(rates))
