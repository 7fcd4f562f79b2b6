"""Every benchmark script imports: a renamed bigmem function breaks a script only when someone runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.rglob("*.py") if path.parent != BENCHMARKS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(BENCHMARKS)))
def test_the_script_imports_and_has_a_main(path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)  # the scripts run nothing at import: main() is behind __name__ == "__main__"
    assert callable(getattr(module, "main", None)) or path.stem in ("torch_unet3d", "gpu_reference")
