"""Layers point down (ARCHITECTURE.md, "Layers"): a module imports only from its own unit or from a lower layer.

A unit is a subpackage (``bigmem/nets``) or a top-level module (``bigmem/units.py``). Every
import counts, at module level or inside a function: an import moved into a function to dodge
this test is still an upward import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bigmem

# Lowest first. Units in one layer are independent of each other.
LAYERS = (
    ("", "errors"),  # "": bigmem/__init__.py (__version__); exceptions every layer raises
    ("units",),  # byte sizes and their parsing: the messages of every layer above name sizes
    # Low-level utilities that need no other bigmem code but errors and units: atomic, the one
    # writer of files (disk-full messages name sizes); the one place TensorFlow is imported
    # (tfenv is told the thread-pool sizes by numa.apply, it never reads numa); cpu:
    # /proc/cpuinfo, read by nets' kernel choices; child: the request/result protocol of the
    # processes memory measures in; cache: the user's cache folder.
    ("atomic", "tfenv", "cpu", "child", "cache"),
    # The run directory's files and readers, and its checkpoints: both written through atomic.
    ("rundir", "checkpoints"),
    ("config",),
    ("nets", "data", "numa"),
    # sysinfo describes the machine: it reads numa's topology and tfenv's oneDNN reason, and
    # memory's calibration and planner read the CPU's ISA from it. speed predicts a step's time from
    # its FLOPs and this CPU's measured rate (config's tables, nets' tuning); the planner reads it.
    ("sysinfo", "speed"),
    ("memory",),
    # monitor reads memory's /proc readers; infer (predict, evaluate, sliding windows, the source
    # geometry) reads memory's inference plan; the trainer runs both. tune times the network's
    # kernel choices and measures memory's fixed term on this machine; train runs it first.
    ("distribute", "monitor", "infer", "tune"),
    ("train",),
    # compare's child process trains each path through train's Python API; compare predicts and
    # evaluates both paths (infer)
    ("compare",),
    # the library a notebook uses; each subcommand parses its flags and calls it
    ("api",),
    ("cli",),
    ("__main__",),  # python -m bigmem: the command line
)


def _unit_of(module: str) -> str:
    """'bigmem.nets.unet3d' -> 'nets'; 'bigmem' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, package: str) -> list[str]:
    """The bigmem modules an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == package]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    if base.split(".")[0] != package:
        return []
    if base == package:  # from bigmem import units: each name is a unit (or __version__)
        return [f"{package}.{alias.name}" if alias.name != "__version__" else package for alias in node.names]
    return [base]


def upward_imports(root: Path, package: str = "bigmem", layers=LAYERS) -> list[str]:
    """Every import under ``root`` (the package folder) that does not point down, one line each."""
    rank = {unit: index for index, units in enumerate(layers) for unit in units}
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root, package)
        unit = _unit_of(module)
        where = path.relative_to(root.parent)
        if unit not in rank:
            problems.append(f"{where}: unit {unit!r} has no layer in tests/test_layers.py's LAYERS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported(node, module, path.name == "__init__.py", package):
                other = _unit_of(target)
                if other == unit:
                    continue
                if other not in rank:
                    problems.append(f"{where}:{node.lineno} imports {target}, whose unit {other!r} has no layer")
                elif rank[other] >= rank[unit]:
                    relation = "the same layer" if rank[other] == rank[unit] else "a higher layer"
                    problems.append(f"{where}:{node.lineno} imports {target} from {relation} "
                                    f"({unit or 'bigmem'} is layer {rank[unit]}, {other or 'bigmem'} is {rank[other]})")
    return problems


def test_bigmem_imports_point_down():
    problems = upward_imports(Path(bigmem.__file__).parent)
    assert not problems, "Imports that do not point down (ARCHITECTURE.md, 'Layers'):\n" + "\n".join(problems)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fake"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_LAYERS = (("", "errors"), ("config",), ("nets", "data"), ("train",))


@pytest.mark.parametrize("source, expected", [
    ("from fake.train.loop import fit\n", "fake/nets/blocks.py:1 imports fake.train.loop from a higher layer "
                                          "(nets is layer 2, train is 3)"),
    ("def f():\n    import fake.train.loop\n", "fake/nets/blocks.py:2 imports fake.train.loop from a higher layer "
                                               "(nets is layer 2, train is 3)"),
    ("from ..train import loop\n", "fake/nets/blocks.py:1 imports fake.train from a higher layer "
                                   "(nets is layer 2, train is 3)"),
    ("from fake import train\n", "fake/nets/blocks.py:1 imports fake.train from a higher layer "
                                 "(nets is layer 2, train is 3)"),
    ("from fake.data.store import Store\n", "fake/nets/blocks.py:1 imports fake.data.store from the same layer "
                                            "(nets is layer 2, data is 2)"),
    ("from fake.monitor import x\n", "fake/nets/blocks.py:1 imports fake.monitor, whose unit 'monitor' has no layer"),
])
def test_an_import_that_does_not_point_down_is_named(tmp_path, source, expected):
    root = _fake_package(tmp_path, {"nets/__init__.py": "", "nets/blocks.py": source, "train/__init__.py": "",
                                    "train/loop.py": "from fake.nets.blocks import f\nfrom . import loop\n"})
    assert upward_imports(root, "fake", FAKE_LAYERS) == [expected]


def test_downward_and_own_unit_imports_pass(tmp_path):
    root = _fake_package(tmp_path, {
        "errors.py": "",
        "config/__init__.py": "from fake.config.schema import Config\nfrom fake import errors, __version__\n",
        "config/schema.py": "import fake.errors\nfrom .options import x\n",
        "train/loop.py": "def f():\n    from fake.nets.blocks import g\n    from fake.config import Config\n",
    })
    assert upward_imports(root, "fake", FAKE_LAYERS) == []


def test_a_unit_without_a_layer_is_named(tmp_path):
    root = _fake_package(tmp_path, {"plugins.py": "import os\n"})
    assert upward_imports(root, "fake", FAKE_LAYERS) == ["fake/plugins.py: unit 'plugins' has no layer in "
                                                         "tests/test_layers.py's LAYERS"]
