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
