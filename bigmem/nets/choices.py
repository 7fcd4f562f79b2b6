"""Speed-motivated kernel choices, per ISA class: which weight gradient each convolution uses.

This machine's tuning (``bigmem tune``, nets/tuning.py) comes first where it has one; else the
decisions are data, bigmem/measured/kernel_choices.json, each with where it came from
(``python benchmarks/tables/bench_kernel_choices.py --write-table`` writes the classes it measured; the
timings are in benchmarks/results/kernel_choices-*.json); this module reads them. A class
measured with oneDNN capped at it (``ONEDNN_MAX_CPU_ISA``) on a bigger CPU says so in its
``source``. TensorFlow-free, so the planner and ``bigmem info`` can read it.
"""

from __future__ import annotations

import dataclasses
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
    required: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # correctness: never tuned away
    # This machine's tuning: (precision, stride, input channels) -> planewise or not, where it was timed.
    exact: dict[tuple[str, int, int], bool] = field(default_factory=dict)

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
        required = {(item["precision"], item["stride"]): tuple(item["in_channels"])
                    for item in correctness.get("planewise", [])}
        return cls(planewise, frozenset(correctness.get("planewise_others", ())), entry["summary"], required)

    def tuned(self, tuning) -> "KernelChoices":
        """These choices with this machine's tuned ones (``nets.tuning.Tuning``): a decision per (precision,
        stride, input channels) it timed, the shipped range elsewhere; a correctness choice (``required``)
        still wins."""
        return dataclasses.replace(self, exact=tuning.planewise_counts(),
                                   source=f"{tuning.describe()}; shipped otherwise: {self.source}")

    def takes_planewise(self, precision: str, stride: int, in_channels: int) -> bool:
        """Whether a 3x3x3 conv of this precision, stride and input channels takes the planewise weight gradient."""
        required = self.required.get((precision, stride))
        if required is not None and required[0] <= in_channels <= required[1]:
            return True
        if (precision, stride, in_channels) in self.exact:
            return self.exact[(precision, stride, in_channels)]
        shipped = self.planewise.get((precision, stride))
        return shipped is not None and shipped[0] <= in_channels <= shipped[1]


# The decisions per ISA class, with the machine, command, results files and notes behind each
# (AMX's bf16 entry is for correctness, not speed): bigmem/measured/kernel_choices.json.
CHOICES: dict[str, KernelChoices] = {
    isa: KernelChoices.from_table(entry)
    for (isa,), entry in tables.serving(tables.load("kernel_choices"), "isa_class").items()
}


def planewise_ranges(seconds: dict[tuple[str, int, int], tuple[float, float]]
                     ) -> dict[tuple[str, int], tuple[int, int]]:
    """The planewise weight gradient's input-channel range per (precision, stride), from timings.

    The one rule, for the shipped tables (benchmarks/tables/bench_kernel_choices.py) and this
    machine's tuning (bigmem/tune.py): planewise at an input-channel count where its time was at
    most oneDNN's; a range only where those counts are consecutive among the measured ones
    (scattered wins are noise: none is chosen).

    Args:
        seconds: ``(precision, stride, in channels) -> (planewise seconds, oneDNN seconds)``, each
            summed over the shapes timed.

    Returns:
        ``(precision, stride) -> (fewest, most)`` where planewise is chosen; pairs absent: never.

    Example:
        >>> planewise_ranges({("bf16", 1, 16): (1.0, 2.0), ("bf16", 1, 32): (1.0, 2.0), ("bf16", 1, 64): (3.0, 2.0)})
        {('bf16', 1): (16, 32)}
    """
    ranges = {}
    for precision, stride in dict.fromkeys(key[:2] for key in seconds):
        counts = sorted(c for p, s, c in seconds if (p, s) == (precision, stride))
        wins = [c for c in counts if seconds[(precision, stride, c)][0] <= seconds[(precision, stride, c)][1]]
        if wins and counts.index(wins[-1]) - counts.index(wins[0]) == len(wins) - 1:
            ranges[(precision, stride)] = (wins[0], wins[-1])
    return ranges


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
    """(ISA class, its choices) for this process: read once, from the CPU and ONEDNN_MAX_CPU_ISA, and
    this machine's tuning (``bigmem tune``, nets/tuning.py) where it has one for its key.

    Returns:
        ``(class name, KernelChoices)``; an unknown class gets the baseline's choices. Writing a
        tuning (``tuning.save_tuning``) clears this cache.
    """
    from dataclasses import asdict

    from bigmem.nets.tuning import key_here, load_tuning

    key = key_here()
    shipped = CHOICES.get(key.isa_class, CHOICES["baseline"])
    tuning = load_tuning()
    if tuning is not None and tuning.key == asdict(key):
        return key.isa_class, shipped.tuned(tuning)
    return key.isa_class, shipped


def planewise_channels(precision: str, stride: int) -> tuple[int, int] | None:
    """The input-channel range of the planewise weight gradient for this process's ISA class, else None.

    Args:
        precision: ``"fp32"`` or ``"bf16"``.
        stride: 1 or 2.

    Returns:
        ``(fewest, most)`` input channels (inclusive), or None: never planewise.
    """
    return kernel_choices()[1].planewise.get((precision, stride))


def takes_planewise(precision: str, stride: int, in_channels: int) -> bool:
    """Whether this process's choices (tuned, else shipped) take the planewise weight gradient for this conv.

    Args:
        precision: ``"fp32"`` or ``"bf16"``.
        stride: 1 or 2.
        in_channels: the conv's input channels.
    """
    return kernel_choices()[1].takes_planewise(precision, stride, in_channels)


def planewise_others(precision: str) -> bool:
    """Whether the head's 1x1x1 and the transposed conv's weight gradients run as 2-D ones here.

    Args:
        precision: ``"fp32"`` or ``"bf16"``.

    Returns:
        True where this process's ISA class needs it (nets/choices.py: AMX in bf16).
    """
    return precision in kernel_choices()[1].planewise_others
