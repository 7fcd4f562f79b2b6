"""Functions in bigmem/ are at most 60 lines, from ``def`` to their last line, docstring included.

``LONGER`` lists the functions written before the rule that are still longer; each is to be
split, and the list may only shrink: a function in it that is now short enough fails the test
until it is taken off, and a function not in it that is too long fails it too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bigmem"
MAX_LINES = 60
LONGER = {
    "data/nifti.py:read_dataset_json",
    "distribute/pernode.py:run_workers",
    "data/transforms.py:resample_label",
    "infer/predict.py:predict",
    "infer/sliding.py:sliding_window",
    "memory/estimate.py:_train",
    "memory/estimate.py:_forward",
    "api.py:plan",
    "tune.py:tune",
    "memory/plans.py:plan_job",
    "train/loop.py:run_loop",
    "config/topology.py:pool_and_kernels",
    "atomic.py:atomic_output",
    "train/trainer.py:train",
    "nets/slabplan.py:plan_conv",
    "monitor/report.py:make_plots",
}


def function_lengths(package: Path = PACKAGE) -> dict[str, int]:
    """``{"unit/module.py:name": lines}`` for every function and method (methods as ``Class.name``)."""
    lengths = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        item.qualified = f"{node.name}.{item.name}"  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = getattr(node, "qualified", node.name)
                key = f"{path.relative_to(package)}:{name}"
                lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_longer_than_60_lines():
    longer = {key: lines for key, lines in function_lengths().items() if lines > MAX_LINES and key not in LONGER}
    assert longer == {}


def test_every_function_listed_as_longer_still_is():
    lengths = function_lengths()
    shorter = sorted(key for key in LONGER if lengths.get(key, 0) <= MAX_LINES)
    assert shorter == []


def test_lengths_count_the_docstring(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    (tmp_path / "m.py").write_text(f'def f():\n    """Doc."""\n{body}\n\n\nclass C:\n    def g(self):\n        pass\n')
    assert function_lengths(tmp_path) == {"m.py:f": 60, "m.py:C.g": 2}
