"""``bigmem.api``: the library under the CLI, run as docs/api.md shows it (its Python blocks, in order)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_importing_the_api_imports_no_tensorflow():
    code = "import sys, bigmem.api; print('tensorflow' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_every_api_function_has_an_example():
    from bigmem import api

    for name in api.__all__:
        function = getattr(api, name)
        if callable(function) and not isinstance(function, type):
            assert "Example:" in (function.__doc__ or ""), f"api.{name} has no Example"


@pytest.mark.slow
def test_the_walkthrough_runs_convert_plan_train_predict_evaluate(tmp_path):
    """The Python blocks of docs/api.md run as one script in an empty folder: a notebook's run of the chain."""
    script = tmp_path / "walkthrough.py"
    script.write_text("\n".join(_blocks()))
    env = {**os.environ, "BIGMEM_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "['sphere_000', 'sphere_001', 'sphere_002', 'sphere_003']" in run.stdout
    assert (tmp_path / "runs" / "spheres" / "model.keras").exists()
    assert (tmp_path / "predictions" / "sphere_100.nii.gz").exists()
    assert (tmp_path / "predictions" / "summary.json").exists()


def test_the_walkthrough_has_its_blocks():
    assert len(_blocks()) == 4
