"""Functions in bigmem/ are at most 60 lines, from ``def`` to their last line, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bigmem"
MAX_LINES = 60


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
    longer = {key: lines for key, lines in function_lengths().items() if lines > MAX_LINES}
    assert longer == {}


def test_lengths_count_the_docstring(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    (tmp_path / "m.py").write_text(f'def f():\n    """Doc."""\n{body}\n\n\nclass C:\n    def g(self):\n        pass\n')
    assert function_lengths(tmp_path) == {"m.py:f": 60, "m.py:C.g": 2}
