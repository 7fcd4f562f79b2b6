"""Speed-motivated kernel choices, per ISA class: which weight gradient each convolution uses.

The numbers behind each entry are in benchmarks/results/kernel_choices-*.json (measured with
``python benchmarks/bench_kernel_choices.py``); this module holds only the decisions. A class
measured with oneDNN capped at it (``ONEDNN_MAX_CPU_ISA``) on a bigger CPU says so in its
``source``. TensorFlow-free, so the planner and ``bigmem info`` can read it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

# ONEDNN_MAX_CPU_ISA values -> the ISA class they cap oneDNN at (oneDNN's names, upper case).
ONEDNN_ISA_CAPS = {"SSE41": "baseline", "AVX": "baseline", "AVX2": "avx2", "AVX2_VNNI": "avx2",
                   "AVX2_VNNI_2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512",
                   "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE_FP16": "avx512_bf16",
                   "AVX512_CORE_AMX": "amx", "AVX512_CORE_AMX_FP16": "amx", "DEFAULT": None, "ALL": None}
CLASS_ORDER = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True)
class KernelChoices:
    """The kernels picked for one ISA class.

    Attributes:
        planewise: (precision, stride) -> (fewest, most) input channels for which the 3x3x3
            conv's weight gradient runs as three batched 2-D ones (nets/conv.py); absent: never.
        planewise_others: precisions in which the 1x1x1 conv's (the head's) and the
            kernel == stride transposed conv's weight gradients run as 2-D ones too
            (``pointwise_weight_grad``, ``transposed_weight_grad`` in nets/conv.py).
        source: where the decision comes from (a results file, or "on paper" and why).
    """

    planewise: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    planewise_others: frozenset[str] = frozenset()
    source: str = ""


# Planewise where it was at least as fast at 96^3 and within 10% at 64^3 (one weight gradient,
# forward excluded); benchmarks/results/kernel_choices-avx512_bf16-amd-epyc-20261130-195005.json, AMD EPYC 2 vCPU,
# TF 2.21.0, oneDNN on. avx512 and avx2 were measured with oneDNN capped at them
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE / AVX2) on that avx512_bf16 CPU: oneDNN's kernels are the
# smaller CPU's, TensorFlow's own Eigen kernels are not.
MEASURED = "benchmarks/results/kernel_choices-avx512_bf16-amd-epyc-20261130-195005.json"
CHOICES: dict[str, KernelChoices] = {
    # bf16: planes faster from 16 channels (stride 1) and 8 (stride 2). fp32: only stride 2 from
    # 64 in-channels; at 32 -> 64 oneDNN's own is faster (timings: benchmarks/results/kernels.md).
    "avx512_bf16": KernelChoices(
        planewise={("bf16", 1): (16, 64), ("bf16", 2): (8, 64), ("fp32", 2): (64, 64)},
        source=f"measured on avx512_bf16: {MEASURED}"),
    # fp32 only (bf16 is emulated here and never chosen): stride 2 from 32 in-channels.
    "avx512": KernelChoices(planewise={("fp32", 2): (32, 64)},
                            source=f"measured with oneDNN capped at AVX512_CORE: {MEASURED}"),
    # oneDNN's AVX2 weight gradients are its weakest: planes faster up to 32 channels (stride 1;
    # 64 -> 64 is slower) and up to 64 (stride 2) (timings: benchmarks/results/kernels.md).
    "avx2": KernelChoices(planewise={("fp32", 1): (8, 32), ("fp32", 2): (8, 64)},
                          source=f"measured with oneDNN capped at AVX2: {MEASURED}"),
    "baseline": KernelChoices(planewise={}, source="no oneDNN fast path to beat: TF's own kernels"),
}
# AMX: bf16 weight gradients of 3x3x3 convs are always planewise, for correctness, not speed: on an
# Intel Xeon with AMX (2 vCPU VM, TF 2.21, oneDNN on, 2026-12-01) TF's bf16 Conv3DBackpropFilterV2
# killed the process (SIGSEGV, or SIGILL) at planes of 512^2 for every channel count tried (1-16
# in, 2 out, 2-8 planes; stride 2 32 -> 64 too), and ran at 384^2 and below; fp32 ran, and the 2-D
# bf16 weight gradient ran at 512^2 and 1024^2 (benchmarks/results/kernels.md). The head's 1x1x1
# kernel gradient and the 2x2x2 transposed conv's died the same way from 256^2 planes when the
# depth was short (4-32 planes; a last depth slab can be that short) or gave NaN; their 2-D forms
# ran and matched float32. fp32 keeps avx512_bf16's choices, on paper (not timed on AMX).
CHOICES["amx"] = KernelChoices(
    planewise={**CHOICES["avx512_bf16"].planewise, ("bf16", 1): (1, 4096), ("bf16", 2): (1, 4096)},
    planewise_others=frozenset({"bf16"}),
    source="bf16: every weight gradient 2-D (oneDNN's AMX 3-D bf16 weight gradients crashed from "
           "256^2 planes); fp32 on paper: avx512_bf16's choices")


def effective_isa_class(detected: str, environ: dict | None = None) -> str:
    """The ISA class oneDNN runs at: the CPU's, or lower where ONEDNN_MAX_CPU_ISA caps it.

    Args:
        detected: the CPU's class, one of CLASS_ORDER (``bigmem.cpu.isa_class``).
        environ: the environment to read ONEDNN_MAX_CPU_ISA from (default ``os.environ``).

    Returns:
        One of CLASS_ORDER; ``detected`` itself when there is no known cap or it is unknown.

    Example:
        >>> effective_isa_class("avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX2"})
        'avx2'
    """
    environ = os.environ if environ is None else environ
    cap = ONEDNN_ISA_CAPS.get(str(environ.get("ONEDNN_MAX_CPU_ISA", "")).upper())
    if cap is None or detected not in CLASS_ORDER:
        return detected
    return min(detected, cap, key=CLASS_ORDER.index)


@functools.lru_cache(maxsize=1)
def kernel_choices() -> tuple[str, KernelChoices]:
    """(ISA class, its choices) for this process: read once, from the CPU and ONEDNN_MAX_CPU_ISA.

    Returns:
        ``(class name, KernelChoices)``; an unknown class gets the baseline's choices.
    """
    from bigmem.cpu import cpu_description, isa_class

    name = effective_isa_class(isa_class(cpu_description()["isa"]))
    return name, CHOICES.get(name, CHOICES["baseline"])


def planewise_channels(precision: str, stride: int) -> tuple[int, int] | None:
    """The input-channel range of the planewise weight gradient for this process's ISA class, else None.

    Args:
        precision: ``"fp32"`` or ``"bf16"``.
        stride: 1 or 2.

    Returns:
        ``(fewest, most)`` input channels (inclusive), or None: never planewise.
    """
    return kernel_choices()[1].planewise.get((precision, stride))


def planewise_others(precision: str) -> bool:
    """Whether the head's 1x1x1 and the transposed conv's weight gradients run as 2-D ones here.

    Args:
        precision: ``"fp32"`` or ``"bf16"``.

    Returns:
        True where this process's ISA class needs it (nets/choices.py: AMX in bf16).
    """
    return precision in kernel_choices()[1].planewise_others
