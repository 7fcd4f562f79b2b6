"""The CPU as bigmem sees it: model, CPU counts and the ISA flags that choose kernels and precision.

A low layer (it imports only ``bigmem.errors``): nets' kernel choices, the planner and ``bigmem info``
all read the ISA from here.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import psutil

from bigmem.errors import UsageError

# ISA extensions that matter for training speed (names as /proc/cpuinfo spells them).
TRAINING_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                      "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert")


# ISA classes a memory calibration is keyed by, most capable first (the flag that defines each):
# they select different oneDNN kernels, and bf16 is native only on the first two
# (benchmarks/results/speed.md, "oneDNN and bf16 by ISA class").
ISA_CLASSES = (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2"))
NATIVE_BF16_ISA_CLASSES = ("amx", "avx512_bf16")
# The flags each class implies (and the flags above it that it lacks): what ISA_CLASS_VARIABLE sets.
CLASS_FLAGS = {"amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                       "amx_int8"),
               "avx512_bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"),
               "avx512": ("avx2", "fma", "avx512f", "avx512bw"),
               "avx2": ("avx2", "fma")}
# Names an ISA class (ISA_CLASSES) that bigmem takes this CPU to be, in place of its /proc/cpuinfo
# flags: its memory tables, kernel choices, tuning file and bf16 decision are looked up for that
# class. oneDNN's kernels do not change (ONEDNN_MAX_CPU_ISA caps those). For checking that the
# suite and the planner hold on every class from a machine of one.
ISA_CLASS_VARIABLE = "BIGMEM_ISA_CLASS"


def forced_isa_class(environ=None) -> str | None:
    """The class ``ISA_CLASS_VARIABLE`` names, or None where it is unset.

    Raises:
        UsageError: it names no class (the message lists the valid ones).
    """
    environ = os.environ if environ is None else environ
    value = str(environ.get(ISA_CLASS_VARIABLE, "")).strip().lower()
    if not value:
        return None
    if value not in CLASS_FLAGS:
        raise UsageError(f"Invalid {ISA_CLASS_VARIABLE}={value!r}: expected one of {', '.join(CLASS_FLAGS)}, or unset "
                         "it to use this CPU's own flags.")
    return value


def _forced_flags(flags: set[str], forced: str) -> set[str]:
    """``flags`` with those that define a class set as ``forced`` has them: its own set, those above cleared."""
    defining = {flag for flags_of in CLASS_FLAGS.values() for flag in flags_of}
    kept = flags - defining - ({"avx512_fp16", "avx_ne_convert"} if forced != "amx" else set())
    return kept | set(CLASS_FLAGS[forced])


def model_name(name: str, family: str, model: str) -> str:
    """The CPU's model as bigmem keys its tables and tunings on: its name, and where the name has no model
    number (what a hypervisor shows: "Intel(R) Xeon(R) Processor", "AMD EPYC"), its x86 family and model
    too, which the hypervisor passes through and which tell CPU generations apart (a Sapphire Rapids Xeon is
    family 6 model 143, an Emerald Rapids one model 207; their memory and speed tables differ).

    Example:
        >>> model_name("Intel(R) Xeon(R) Processor", "6", "207")
        'Intel(R) Xeon(R) Processor (family 6 model 207)'
        >>> model_name("AMD EPYC 9654 96-Core Processor", "25", "17")
        'AMD EPYC 9654 96-Core Processor'
    """
    if any(c.isdigit() for c in name) or not (family.isdigit() and model.isdigit()):
        return name
    return f"{name} (family {family} model {model})"


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
    """This CPU: its model (``model_name``), ISA flags, CPU counts; ``proc_root`` is where cpuinfo is read."""
    model, flags, signature = platform.processor() or "unknown", set(), {}
    cpuinfo = Path(proc_root) / "cpuinfo"
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("unknown", "", platform.processor()):
                model = value.strip()
            elif key in ("cpu family", "model") and key not in signature:
                signature[key] = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    model = model_name(model, signature.get("cpu family", ""), signature.get("model", ""))
    forced = forced_isa_class()
    if forced is not None:
        flags = _forced_flags(flags, forced)
    return {
        "model": model,
        "isa_class_forced": forced,
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
