"""Where every benchmark writes its JSON: ``<out>/<kind>-<machine>-<timestamp>.json``, atomically.

``<machine>`` is the ISA class and the CPU model (``avx512_bf16-amd-epyc``), never the host name: a
results file says which kind of machine measured it, and two VMs of one kind share a key. The
benchmarks that measure a shipped table (bigmem/measured/) replace this machine's entry of it with
``write_table`` when given ``--write-table``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from bigmem.atomic import atomic_write_json

REPO = Path(__file__).resolve().parents[1]


def slug(isa_class: str, cpu: str) -> str:
    """'<ISA class>-<CPU model>' in lower case: slug('amx', 'Intel(R) Xeon(R) Processor') == 'amx-intel-xeon'."""
    model = re.sub(r"\(r\)|\(tm\)|\bcpu\b|@.*|\bprocessor\b|\d+-core", "", cpu.lower())
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "unknown-cpu"
    return f"{isa_class}-{model}"


def machine_slug() -> str:
    """This machine's slug, e.g. 'avx512_bf16-amd-epyc' or 'amx-intel-xeon-platinum-8481c'."""
    from bigmem.memory.calibration import machine_cpu_model, machine_isa_class

    return slug(machine_isa_class(), machine_cpu_model())


def write_results(kind: str, report: dict, out: str | Path, console=None) -> Path:
    """Write ``report`` keyed by machine and time; print where it went."""
    path = Path(out) / f"{kind}-{machine_slug()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_json(path, report)
    if console is not None:
        console.print(f"wrote {path}")
    return path


def write_table(name: str, values: dict, *, results: str | Path, notes: list[str], summary: str | None = None,
                key: str | None = None, isa_class: str | None = None, machine: dict | None = None,
                keep: tuple[str, ...] = (), console=None) -> Path:
    """Replace this machine's entry of the shipped table ``name`` (bigmem/measured/NAME.json): ``--write-table``.

    Args:
        name: the table (``bigmem.config.tables.NAMES``).
        values: the entry's values (its "tables", "rates" or "planewise").
        results: the results file this run wrote (``write_results``), recorded as the entry's source.
        notes: what the reader of the table should know about these values.
        summary: the one line the estimate prints with them (default: CPU, CPUs, ISA class, TF, date).
        key: the entry's key (default: ``machine_slug()``).
        isa_class: the class the entry serves (default: this CPU's).
        machine: more about the machine (e.g. a oneDNN cap), beside CPU model, ISA class, TF version, CPUs.
        keep: fields of the entry being replaced to carry over (what this run does not measure).

    Returns:
        The table's path. The entry records the date and this command line; review its diff before committing.
    """
    from harness import command_line  # here: harness imports this module
    from bigmem.config import tables
    from bigmem.memory.calibration import machine_cpu_model, machine_isa_class, tensorflow_version

    key = key or machine_slug()
    results = Path(results).resolve()
    try:
        recorded = str(results.relative_to(REPO))
    except ValueError:
        recorded = str(results)
    if not recorded.startswith("benchmarks/results/") and console is not None:
        console.print(f"note: {results} is outside benchmarks/results/: commit it there with the table, which names it")
    date = time.strftime("%Y-%m-%d")
    about = {"cpu": machine_cpu_model(), "isa_class": machine_isa_class(), "tensorflow": tensorflow_version(),
             "cpus": os.cpu_count(), **(machine or {})}
    old = tables.load(name).get(key, {})
    entry = {"isa_class": isa_class or about["isa_class"], "machine": about,
             "summary": summary or f"{about['cpu']} {about['cpus']} CPUs {about['isa_class']}, "
                                   f"TF {about['tensorflow']}, {date}",
             "date": date, "command": command_line(sys.argv[0]), "results": [recorded], "notes": notes,
             **values, **{field: old[field] for field in keep if field in old}}
    measured = {_table_id(t) for t in values.get("tables", [])}
    dropped = [_table_id(t) for t in old.get("tables", []) if _table_id(t) not in measured]
    if dropped and console is not None:
        console.print(f"note: the {key} entry it replaces also had {', '.join(dropped)}, which this run did not "
                      "measure: they are gone from the table")
    path = tables.write_entry(name, key, entry)
    if console is not None:
        console.print(f"wrote entry {key!r} of {path}")
    return path


def _table_id(table: dict) -> str:
    """'kits19 bf16 stages': what one of an entry's tables is for (its fields that are not lists)."""
    return " ".join(str(v) for v in table.values() if not isinstance(v, (list, dict)))
