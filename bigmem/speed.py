"""Predicted step time of a training configuration: its FLOPs over a measured rate per ISA class.

A plan that only says what bf16 and recomputation save hides what they cost. The rate a 3D
U-Net step reaches depends on the CPU's ISA class, the precision and how wide the network is
(narrow convolutions use the vector units worse), so the rates below are per (ISA class,
precision) at the base widths that were measured, interpolated on log2(base filters) between
them. Every figure is per core and says where it comes from; an ISA class that was not measured
borrows the nearest one's figure and says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

from bigmem.config import tables

# GFLOP/s per core of bigmem's own training step (benchmarks/tables/bench_train.py), per (ISA class,
# precision) by base filters, and where each class's figures came from. Data, one entry per
# measuring machine with its command, results files and notes (a shared VM's rate moves with its
# host, so these are a start; `bigmem profile --calibrate` times the machine itself):
# bigmem/measured/step_rates.json (benchmarks/tables/bench_train.py --write-table).
_RATES = tables.serving(tables.load("step_rates"), "isa_class")
MEASURED_RATES: dict[tuple[str, str], dict[int, float]] = {
    (isa, precision): {r["base_filters"]: r["gflops_per_core"] for r in entry["rates"] if r["precision"] == precision}
    for (isa,), entry in _RATES.items() for precision in dict.fromkeys(r["precision"] for r in entry["rates"])
}
RATE_SOURCES = {isa: entry["summary"] for (isa,), entry in _RATES.items()}
# Classes that were not measured, and the measured class whose figures they use.
BORROWED_RATES = {
    "avx512": "avx512_bf16",  # the same fp32 kernels; bf16 emulated (below)
    "baseline": "avx2",
}
# Without native bf16 oneDNN emulates it: 20x slower than fp32 (0.016 vs 0.33 Mvox/s on AVX2, the
# avx2 entry's notes in bigmem/measured/step_rates.json).
EMULATED_BF16_SLOWDOWN = 20.0
# A recomputed stage runs its forward pass twice: the step does 1/3 more of that stage's work
# (forward 1 + backward 2 -> 4).
RECOMPUTE_EXTRA_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class StepRate:
    """GFLOP/s per core for one (ISA class, precision, base filters), with where it came from."""

    gflops_per_core: float
    source: str


def _interpolate(points: dict[int, float], base_filters: int) -> float:
    """The rate at ``base_filters``, log-linear in the width between measured widths, flat outside."""
    widths = sorted(points)
    if base_filters in points:
        return points[base_filters]
    if base_filters <= widths[0]:
        return points[widths[0]]
    for low, high in zip(widths, widths[1:]):
        if base_filters <= high:
            t = (math.log2(base_filters) - math.log2(low)) / (math.log2(high) - math.log2(low))
            return points[low] * (points[high] / points[low]) ** t
    return points[widths[-1]]


def step_rate(isa_class: str, precision: str, base_filters: int, native_bf16: bool) -> StepRate:
    """The rate a training step of this width reaches per core on this ISA class and precision.

    Args:
        isa_class: as ``cpu.isa_class`` gives it ("amx", "avx512_bf16", "avx512", "avx2", "baseline").
        precision: "fp32" or "bf16".
        base_filters: the network's first-level filters.
        native_bf16: whether the CPU runs bf16 natively (else bf16 is emulated).
    """
    measured = isa_class if isa_class in RATE_SOURCES else BORROWED_RATES.get(isa_class, "avx2")
    source = RATE_SOURCES[measured] + ("" if measured == isa_class else f"; {isa_class} not measured, "
                                                                         f"{measured}'s figures used")
    emulated = precision == "bf16" and not native_bf16
    table = MEASURED_RATES[(measured, "fp32" if emulated and measured != "avx2" else precision)]
    reference = MEASURED_RATES[("avx512_bf16", "fp32" if emulated else precision)]
    if len(table) == 1 and base_filters not in table:  # scale one measured width as avx512_bf16's scale
        width = next(iter(table))
        rate = table[width] * _interpolate(reference, base_filters) / _interpolate(reference, width)
    else:
        rate = _interpolate(table, base_filters)
    if emulated and measured != "avx2":
        rate /= EMULATED_BF16_SLOWDOWN
        source += f"; bf16 emulated: fp32 / {EMULATED_BF16_SLOWDOWN:g}"
    return StepRate(rate, source)


# A training step's share of its whole-network ceiling (the sum of its convolutions' fastest kernels,
# bigmem tune): what a tuned convolution rate becomes as a step rate. Measured by
# benchmarks/tables/bench_ceiling.py (benchmarks/results/ceiling.md).
STEP_SHARE_OF_CEILING = 0.9


def tuned_step_rate(precision: str, base_filters: int, native_bf16: bool) -> StepRate | None:
    """The step rate from this machine's tuning (``bigmem tune``) in ``precision``, or None where it has none.

    The tuned convolutions' rate times ``STEP_SHARE_OF_CEILING``, interpolated over the widths tuned
    as the shipped rates are (a width outside them takes the nearest's).
    """
    from bigmem.nets.tuning import load_tuning

    tuning = load_tuning()
    if tuning is None or (precision == "bf16" and not native_bf16):
        return None
    points = tuning.conv_rates(precision)
    if not points:
        return None
    rate = _interpolate(points, base_filters) * STEP_SHARE_OF_CEILING
    widths = ", ".join(str(width) for width in sorted(points))
    return StepRate(rate, f"tuned on this machine (bigmem tune, base filters {widths}): convolutions at "
                          f"{_interpolate(points, base_filters):.1f} GFLOP/s per core x {STEP_SHARE_OF_CEILING:g}, "
                          "a step's share of that ceiling")


@dataclass(frozen=True)
class MachineSpeed:
    """What the step-time prediction needs to know about the CPU."""

    isa_class: str
    native_bf16: bool
    cores: int

    @classmethod
    def here(cls) -> "MachineSpeed":
        from bigmem.cpu import cpu_description, isa_class, native_bf16

        return cls(isa_class(cpu_description()["isa"]), native_bf16(), usable_cores())


def usable_cores() -> int:
    """CPUs this process may run on (its affinity), as a count of cores for the rate above."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def recomputed_share(block_elements: dict[str, int], stages: Sequence[str]) -> float:
    """The recomputed stages' share of the forward work, by their share of the feature maps (0..1).

    Args:
        block_elements: feature-map elements per stage (``NetworkCounts.block_elements``).
        stages: the recomputed stages' names.
    """
    return sum(block_elements[name] for name in stages) / max(1, sum(block_elements.values()))


def measured_rate(train_flops: int, recomputed: float, step_s: float, cores: int) -> float:
    """GFLOP/s per core that a measured step reached, counted as ``predicted_step_s`` counts them.

    The inverse of ``predicted_step_s``: a rate measured here and fed back predicts ``step_s``.
    """
    flops = train_flops * (1.0 + RECOMPUTE_EXTRA_SHARE * recomputed)
    return flops / (step_s * 1e9 * max(1, cores))


def predicted_step_s(train_flops: int, recomputed_share: float, rate: StepRate, cores: int) -> float:
    """Seconds per step: FLOPs (plus the recomputed forward passes) over the rate times the cores.

    Args:
        train_flops: FLOPs of one training step without recomputation.
        recomputed_share: the share of the forward FLOPs in recomputed stages (0..1).
        rate: from ``step_rate``.
        cores: cores the step runs on.
    """
    flops = train_flops * (1.0 + RECOMPUTE_EXTRA_SHARE * recomputed_share)
    return flops / (rate.gflops_per_core * 1e9 * max(1, cores))
