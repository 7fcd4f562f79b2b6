"""Where every benchmark writes its JSON: ``<out>/<kind>-<machine>-<timestamp>.json``, atomically.

``<machine>`` is the ISA class and the CPU model (``avx512_bf16-amd-epyc``), never the host name: a
results file says which kind of machine measured it, and two VMs of one kind share a key.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from bigmem.atomic import atomic_write_json


def slug(isa_class: str, cpu: str) -> str:
    """'<ISA class>-<CPU model>' in lower case: slug('amx', 'Intel(R) Xeon(R) Processor') == 'amx-intel-xeon'."""
    model = re.sub(r"\(r\)|\(tm\)|\bcpu\b|@.*|\bprocessor\b|\d+-core", "", cpu.lower())
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "unknown-cpu"
    return f"{isa_class}-{model}"


def machine_slug() -> str:
    """This machine's slug, e.g. 'avx512_bf16-amd-epyc' or 'amx-intel-xeon-platinum-8481c'."""
    from bigmem.memory.calibration import cpu_model, machine_isa_class

    return slug(machine_isa_class(), cpu_model())


def write_results(kind: str, report: dict, out: str | Path, console=None) -> Path:
    """Write ``report`` keyed by machine and time; print where it went."""
    path = Path(out) / f"{kind}-{machine_slug()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_json(path, report)
    if console is not None:
        console.print(f"wrote {path}")
    return path
