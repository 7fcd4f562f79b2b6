"""Helpers shared by the tests (imported by name; fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path


def copy_store(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def run_cli(argv, capsys):
    """Run ``bigmem argv`` in-process; return (exit code, stdout, stderr)."""
    from bigmem.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def poison_labels(value: int, voxel=(0, 0, 0)):
    """A mutate() for the corrupt_store fixture: set one label voxel of every case to ``value``."""

    def mutate(handle) -> None:
        for case in handle["cases"]:
            data = handle[f"cases/{case}/label"]
            values = data[...]
            values[voxel] = value
            data[...] = values

    return mutate
