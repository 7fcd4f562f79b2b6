"""Every public function and class says what it takes and gives (Args, Returns, Raises, Example; Keras/MONAI style).

Two checks:

- every object in ``DOCUMENTED`` has the sections its kind needs (a function or method:
  ``Args:`` and ``Returns:``; a class: ``Args:`` and ``Example:``), or those given beside it;
- no public function, class or method defined in a module of ``MODULES`` lacks a docstring
  (read from the source, so nothing is imported for it).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FUNCTION_SECTIONS = ("Args:", "Returns:")
CLASS_SECTIONS = ("Args:", "Example:")

# One entry per object: its dotted path, or (dotted path, the sections it must have) where the
# defaults above do not fit (e.g. a config dataclass: ("bigmem.config.schema.DataConfig",
# ("Attributes:", "Example:"))).
DOCUMENTED: list[str | tuple[str, tuple[str, ...]]] = [
    "bigmem.nets.unet3d.UNet3D",
    "bigmem.nets.unet3d.UNet3D.call",
    "bigmem.data.pipeline.VolumeLoader",
    "bigmem.data.store.HDF5VolumeStore",
    "bigmem.memory.measure.measure",
    "bigmem.compare.run.compare",
    ("bigmem.compare.setup.CompareRequest", ("Attributes:", "Example:")),
    ("bigmem.compare.setup.run_compare", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.train.trainer.train", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.memory.estimate.estimate", ("Args:", "Returns:", "Example:")),
    ("bigmem.memory.search.make_plan", ("Args:", "Returns:", "Example:")),
    ("bigmem.config.presets.resolve_config", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.distribute.execution.data_parallel", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.infer.predict.load_predictor", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.infer.sliding.sliding_window", ("Args:", "Returns:")),
    ("bigmem.infer.evaluate.evaluate", ("Args:", "Returns:")),
    ("bigmem.infer.evaluate.store_reference", ("Args:", "Returns:", "Raises:", "Example:")),
    ("bigmem.infer.metrics.region_metrics", ("Args:", "Returns:", "Raises:", "Example:")),
    *((f"bigmem.data.layouts.{name}", ("Args:", "Returns:", "Raises:", "Example:")) for name in (
        "detect_layout", "read_dataset", "read_nnunet", "read_kits", "list_images")),
    ("bigmem.data.nifti.load_channels", ("Args:", "Returns:", "Raises:", "Example:")),
    *((f"bigmem.config.schema.{name}", ("Attributes:", "Example:")) for name in (
        "ModelConfig", "DataConfig", "TrainConfig", "MemoryConfig", "DistributeConfig", "NUMAConfig",
        "ExperimentConfig")),
]

# Modules whose every public function, class and method has a docstring (paths under bigmem/).
# data/convert.py is not listed: only its ``convert`` is documented so far.
MODULES = [
    "nets/unet3d.py", "nets/conv.py", "nets/norm_act.py", "nets/slabs.py", "nets/blocks.py", "nets/pooling.py",
    "nets/reduce.py", "nets/limits.py", "nets/choices.py", "nets/slabplan.py",
    "data/pipeline.py", "data/store.py", "data/nifti.py", "data/layouts.py",
    "memory/measure.py", "memory/budget.py", "numa/layouts.py", "distribute/execution.py", "distribute/pernode.py",
    "config/tables.py", "config/topology.py", "data/fingerprint.py", "data/experiment.py",
    "compare/run.py", "compare/setup.py", "compare/runner.py", "compare/report.py", "compare/render.py",
    "compare/gpu_reference.py",
    "train/trainer.py", "train/loop.py", "train/callbacks.py", "train/job.py", "train/resume.py",
    "infer/predict.py", "infer/mode.py", "infer/validate.py", "infer/forward.py", "infer/metrics.py",
    "infer/evaluate.py",
    "numa/apply.py", "numa/capacity.py", "numa/observe.py", "numa/policy.py", "numa/topology.py",
    "monitor/report.py", "monitor/sampler.py", "monitor/events.py", "atomic.py", "child.py",
]


def _entry(entry) -> tuple[str, tuple[str, ...] | None]:
    return (entry, None) if isinstance(entry, str) else (entry[0], tuple(entry[1]))


def resolve(dotted: str):
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(f"no module in {dotted!r}")


def missing_sections(doc: str | None, sections: tuple[str, ...]) -> list[str]:
    """The ``sections`` that ``doc`` lacks; a section is a line holding only its heading."""
    return [s for s in sections if not re.search(rf"^\s*{re.escape(s)}\s*$", doc or "", re.MULTILINE)]


def undocumented(path: Path) -> list[str]:
    """Public functions, classes and methods defined in the module at ``path`` without a docstring."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node):
            found.append(f"{node.name} (line {node.lineno})")
        if isinstance(node, ast.ClassDef):
            found += [f"{node.name}.{sub.name} (line {sub.lineno})" for sub in node.body
                      if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and not sub.name.startswith("_") and not ast.get_docstring(sub)]
    return found


@pytest.mark.parametrize("entry", DOCUMENTED, ids=lambda e: _entry(e)[0])
def test_documented_object_has_its_sections(entry):
    dotted, sections = _entry(entry)
    obj = resolve(dotted)
    if sections is None:
        sections = CLASS_SECTIONS if inspect.isclass(obj) else FUNCTION_SECTIONS
    # The object's own docstring: a class without one would otherwise show its base class's.
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert not missing_sections(doc, sections), f"{dotted}: docstring lacks {missing_sections(doc, sections)}"


@pytest.mark.parametrize("module", MODULES)
def test_module_has_no_undocumented_public_object(module):
    assert undocumented(ROOT / "bigmem" / module) == []


def test_unet3d_states_its_size_contract_and_shapes():
    from bigmem.nets.unet3d import UNet3D

    assert "2**depth" in UNet3D.__doc__
    assert "(batch, D, H, W, in_channels)" in UNet3D.__doc__
    assert "(batch, D, H, W, num_classes)" in UNet3D.call.__doc__


def test_the_checks_can_fail(tmp_path):
    assert missing_sections('"""Does a thing.\n\n    Args:\n        x: a thing.\n"""', FUNCTION_SECTIONS) == [
        "Returns:"]
    assert missing_sections("See Args: below; Returns: nothing.", ("Args:",)) == ["Args:"]  # not a heading
    module = tmp_path / "module.py"
    module.write_text('def f():\n    pass\n\n\ndef _g():\n    pass\n\n\nclass C:\n    """C."""\n\n'
                      '    def m(self):\n        pass\n\n    def _n(self):\n        pass\n')
    assert undocumented(module) == ["f (line 1)", "C.m (line 12)"]
