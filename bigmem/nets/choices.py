"""Speed-motivated kernel choices, per ISA class: which weight gradient each convolution uses.

The decisions are data, bigmem/measured/kernel_choices.json, each with where it came from
(``python benchmarks/tables/bench_kernel_choices.py --write-table`` writes the classes it measured; the
timings are in benchmarks/results/kernel_choices-*.json); this module reads them. A class
measured with oneDNN capped at it (``ONEDNN_MAX_CPU_ISA``) on a bigger CPU says so in its
``source``. TensorFlow-free, so the planner and ``bigmem info`` can read it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from bigmem.config import tables

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

    @classmethod
    def from_table(cls, entry: dict) -> "KernelChoices":
        """The choices of one entry of bigmem/measured/kernel_choices.json.

        Args:
            entry: ``planewise``, a list of ``{precision, stride, in_channels: [fewest, most]}``;
                ``summary``; optionally ``correctness``, paths the class must take whatever their
                speed (``planewise`` entries that override the speed choice, ``planewise_others``).

        Returns:
            The KernelChoices, ``source`` the entry's summary.
        """
        correctness = entry.get("correctness", {})
        planewise = {(item["precision"], item["stride"]): tuple(item["in_channels"])
                     for item in entry["planewise"] + correctness.get("planewise", [])}
        return cls(planewise, frozenset(correctness.get("planewise_others", ())), entry["summary"])


# The decisions per ISA class, with the machine, command, results files and notes behind each
# (AMX's bf16 entry is for correctness, not speed): bigmem/measured/kernel_choices.json.
CHOICES: dict[str, KernelChoices] = {
    isa: KernelChoices.from_table(entry)
    for (isa,), entry in tables.serving(tables.load("kernel_choices"), "isa_class").items()
}


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
