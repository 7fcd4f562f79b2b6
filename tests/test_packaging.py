"""The wheel carries every module and the presets, so a non-editable install finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_modules_and_presets(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("bigmem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "bigmem").rglob("*.py") if "models" not in p.parts}
    assert modules <= names, sorted(modules - names)
    presets = {f"bigmem/models/{p.name}" for p in (ROOT / "models").iterdir() if p.suffix in (".toml", ".md")}
    assert presets and presets <= names, sorted(presets - names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "bigmem = bigmem.cli.main:console_main" in entry_points
