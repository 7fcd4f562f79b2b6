"""The wheel carries every module, the presets and the measured tables, so a non-editable install finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bigmem.config import tables

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_modules_presets_and_tables(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("bigmem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "bigmem").rglob("*.py") if "models" not in p.parts}
    assert modules <= names, sorted(modules - names)
    presets = {f"bigmem/models/{p.name}" for p in (ROOT / "models").iterdir() if p.suffix in (".toml", ".md")}
    assert presets, sorted(presets - names)
    assert presets <= names, sorted(presets - names)
    measured = {f"bigmem/measured/{name}.json" for name in tables.NAMES}  # what calibration, speed, choices read
    shipped = {n for n in names if n.startswith("bigmem/measured/")}
    assert measured == shipped, sorted(measured ^ shipped)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "bigmem = bigmem.cli.main:console_main" in entry_points
