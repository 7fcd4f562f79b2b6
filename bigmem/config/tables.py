"""The shipped measured tables (memory calibrations, step rates, kernel choices): data files, read by one lookup.

Each table is one JSON file in ``bigmem/measured/`` (packaged with the wheel), ``{"about": ...,
"entries": {key: entry}}``. An entry is what one measuring command gave on one machine: its key
names the machine (``benchmarks/_results.machine_slug``, the ISA class and CPU model; and the
model, where the command measured one), and besides its values it says where they came from
(``PROVENANCE_FIELDS``): the ISA class it serves, the machine (CPU model, ISA class, TensorFlow
version), the date, the command, the results files under ``benchmarks/results/`` and notes on
how well the values hold. An entry decided on paper, not measured, has no command and no results,
and its notes say why.

The modules that use a table (memory/calibration, speed, nets/choices)
read it once, through ``load`` and ``serving``; the benchmark that measures a table replaces its
machine's entry with ``write_entry`` (``--write-table``). In config, not memory, because nets
reads a table too and config is the layer below both that reads shipped data files (the presets).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from bigmem.atomic import atomic_write_json
from bigmem.config.options import suggest
from bigmem.errors import DataError

NAMES = ("training_memory", "inference_memory", "step_rates", "kernel_choices")
# What every entry says besides its values: what it serves, where and when it was measured, by what, into which
# results files, and how far to trust it.
PROVENANCE_FIELDS = ("isa_class", "machine", "summary", "date", "command", "results", "notes")
MACHINE_FIELDS = ("cpu", "isa_class", "tensorflow")


def tables_dir() -> Path:
    """Where the shipped tables are: ``bigmem/measured/`` (in a checkout, the repository's own files)."""
    return Path(str(resources.files("bigmem") / "measured"))


def table_path(name: str, directory: str | Path | None = None) -> Path:
    """The file of table ``name`` (one of ``NAMES``) in ``directory`` (default: ``tables_dir()``).

    Raises:
        ValueError: ``name`` is not one of ``NAMES``.
    """
    if name not in NAMES:
        raise ValueError(f"Unknown measured table {name!r}: expected one of {', '.join(NAMES)}." + suggest(name, NAMES))
    return Path(directory or tables_dir()) / f"{name}.json"


def check_entry(name: str, key: str, entry: dict) -> None:
    """Raise ``DataError`` naming what ``entry`` of table ``name`` lacks of its provenance.

    An entry needs every ``PROVENANCE_FIELDS``; a measured one (with a command) a machine with
    ``MACHINE_FIELDS``; ``results`` is a list of paths (empty only for one decided on paper).
    """
    missing = [f for f in PROVENANCE_FIELDS if f not in entry]
    if not missing and entry["command"] is not None:
        missing = [f"machine.{f}" for f in MACHINE_FIELDS if f not in (entry["machine"] or {})]
    if missing:
        raise DataError(f"Measured table {name!r}, entry {key!r}: no {', '.join(missing)} (every entry says "
                        f"what it serves and where it came from: {', '.join(PROVENANCE_FIELDS)}).")
    if not isinstance(entry["results"], list) or not isinstance(entry["notes"], list):
        raise DataError(f"Measured table {name!r}, entry {key!r}: 'results' and 'notes' must be lists, got "
                        f"{type(entry['results']).__name__} and {type(entry['notes']).__name__}.")


def load(name: str, *, directory: str | Path | None = None) -> dict[str, dict]:
    """The entries of table ``name``, by key, in the file's order, each checked for its provenance.

    Args:
        name: one of ``NAMES``.
        directory: where the table files are (default: ``tables_dir()``).

    Returns:
        ``{key: entry}``.

    Raises:
        DataError: the file is missing, not JSON, or an entry lacks a provenance field.

    Example:
        >>> load("step_rates")["amx-intel-xeon"]["machine"]["cpu"]
        'Intel(R) Xeon(R) Processor'
    """
    path = table_path(name, directory)
    try:
        entries = json.loads(path.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"Cannot read the measured table {path}: {exc!r}. It ships with bigmem; reinstall, "
                        "or restore it from the repository.") from None
    for key, entry in entries.items():
        check_entry(name, key, entry)
    return entries


def serving(entries: dict[str, dict], *fields: str) -> dict[tuple, dict]:
    """The entry that serves each value of ``fields`` (e.g. the ISA class), in the order they first appear.

    Where two entries serve the same (two CPU models of one class were measured), the one with the
    later date wins (a date range ``A/B`` counts by its end), so that a new measurement replaces an
    old one without its entry being deleted; at an equal date, the later in the file.
    """
    chosen: dict[tuple, dict] = {}
    for entry in entries.values():
        group = tuple(entry[f] for f in fields)
        if group not in chosen or end_date(entry) >= end_date(chosen[group]):
            chosen[group] = entry
    return chosen


def end_date(entry: dict) -> str:
    """An entry's date, the end of a range ``A/B``: what orders two measurements of one thing."""
    return str(entry["date"]).split("/")[-1]


def write_entry(name: str, key: str, entry: dict, *, directory: str | Path | None = None) -> Path:
    """Write ``entry`` as table ``name``'s entry ``key`` (replacing one there), atomically; the others stay.

    Args:
        name: one of ``NAMES``.
        key: the entry's key (the machine, ``benchmarks/_results.machine_slug``, and the model where one).
        entry: values and every ``PROVENANCE_FIELDS``.
        directory: where the table files are (default: ``tables_dir()``, in a checkout the repository's).

    Returns:
        The table's path.

    Raises:
        DataError: ``entry`` lacks a provenance field, or the table there cannot be read.

    Example:
        >>> write_entry("step_rates", "amx-intel-xeon", entry)  # entry: provenance and "rates"
        PosixPath('.../bigmem/measured/step_rates.json')
    """
    check_entry(name, key, entry)
    path = table_path(name, directory)
    data = {"about": "", "entries": {}}
    if path.exists():
        load(name, directory=directory)  # a table already broken is not written to: its other entries would be lost
        data = json.loads(path.read_text())
    data["entries"][key] = entry
    return atomic_write_json(path, data)
