"""README.md and ARCHITECTURE.md point only at code and files that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bigmem"
# `unit/module.name` or `unit/module.Class.method` (ARCHITECTURE.md's way of naming code), or a path
REFERENCE = re.compile(r"`([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)*)`")


def _defined(path: Path) -> set[str]:
    """Top-level names of a module, and Class.member for its classes' members."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _code_references(text: str) -> list[tuple[str, Path, str | None]]:
    """(reference, module file, name or None) for every backticked `unit/module[.name]` naming bigmem code."""
    found = []
    for reference in REFERENCE.findall(text):
        if "/" not in reference or reference.startswith(("tests/", "benchmarks/", "models/")):
            continue
        if reference.endswith("/"):  # a folder of the package, `infer/` (others: `runs/`, a user's, not ours)
            if (PACKAGE / reference).is_dir() or reference.count("/") > 1:
                found.append((reference, PACKAGE / reference, None))
            continue
        module, _, name = reference.partition(".")
        if name == "py":  # a file: `infer/sliding.py`
            name = ""
        path = PACKAGE / f"{module}.py"
        if (PACKAGE / module.split("/")[0]).is_dir() or path.exists():
            found.append((reference, path, name or None))
    return found


@pytest.mark.parametrize("document", ["README.md", "ARCHITECTURE.md"])
def test_code_the_documents_name_exists(document):
    text = (ROOT / document).read_text()
    missing = []
    for reference, path, name in _code_references(text):
        if not path.exists():  # a module file, or a folder
            missing.append(f"{reference}: no {path.relative_to(ROOT)}")
        elif name is not None and name.split(".")[0] not in {n.split(".")[0] for n in _defined(path)}:
            missing.append(f"{reference}: {path.relative_to(ROOT)} defines no {name.split('.')[0]}")
        elif name is not None and "." in name and name not in _defined(path):
            missing.append(f"{reference}: {path.relative_to(ROOT)} has no {name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("document", ["README.md", "ARCHITECTURE.md"])
def test_files_the_documents_name_exist(document):
    text = (ROOT / document).read_text()
    paths = re.findall(r"`((?:bigmem|tests|benchmarks|models)/[\w/.-]*\.(?:py|md|toml))`", text)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert paths, missing
    assert not missing, missing


def test_the_reference_parser_sees_a_dead_pointer():
    assert _code_references("see `infer/predict.no_such_function`, `data/nowhere.thing` and `nets/slabs.py`") == [
        ("infer/predict.no_such_function", PACKAGE / "infer" / "predict.py", "no_such_function"),
        ("data/nowhere.thing", PACKAGE / "data" / "nowhere.py", "thing"),
        ("nets/slabs.py", PACKAGE / "nets" / "slabs.py", None)]
