"""The CPU as bigmem sees it: model, CPU counts and the ISA flags that choose kernels and precision.

The lowest layer (no bigmem imports): nets' kernel choices, the planner and ``bigmem info``
all read the ISA from here.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import psutil

# ISA extensions that matter for training speed (names as /proc/cpuinfo spells them).
TRAINING_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                      "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert")


# ISA classes a memory calibration is keyed by, most capable first (the flag that defines each):
# they select different oneDNN kernels, and bf16 is native only on the first two
# (benchmarks/results/speed.md, "oneDNN and bf16 by ISA class").
ISA_CLASSES = (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2"))
NATIVE_BF16_ISA_CLASSES = ("amx", "avx512_bf16")


def isa_class(isa: dict[str, bool]) -> str:
    """The most capable ISA class whose defining flag is set, else "baseline".

    Args:
        isa: flag -> present, as ``cpu_description()["isa"]`` gives it.

    Returns:
        One of "amx", "avx512_bf16", "avx512", "avx2", "baseline".

    Example:
        >>> isa_class({"avx2": True, "avx512f": True, "avx512_bf16": False})
        'avx512'
    """
    for name, flag in ISA_CLASSES:
        if isa.get(flag):
            return name
    return "baseline"


def cpu_description(proc_root: str | os.PathLike = "/proc") -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path(proc_root) / "cpuinfo"
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("unknown", "", platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    return {
        "model": model,
        "logical_cpus": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "cpus_allowed": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": {flag: flag in flags for flag in TRAINING_ISA_FLAGS},
    }


# "1"/"0" overrides the CPU's flags (a container hiding /proc/cpuinfo; tests that must not depend
# on the CPU they run on).
NATIVE_BF16_VARIABLE = "BIGMEM_NATIVE_BF16"


def native_bf16(proc_root: str | os.PathLike = "/proc") -> bool:
    """Whether this CPU runs bfloat16 natively: an ISA class in NATIVE_BF16_ISA_CLASSES, or
    AVX-NE-CONVERT (oneDNN's avx2_vnni_2). Elsewhere bf16 is emulated, ~20x slower than fp32
    (benchmarks/results/speed.md, "oneDNN and bf16"). NATIVE_BF16_VARIABLE overrides the flags.
    """
    override = os.environ.get(NATIVE_BF16_VARIABLE)
    if override in ("0", "1"):
        return override == "1"
    isa = cpu_description(proc_root)["isa"]
    return isa_class(isa) in NATIVE_BF16_ISA_CLASSES or isa["avx_ne_convert"]
