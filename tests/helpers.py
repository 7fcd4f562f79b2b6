"""Helpers shared by the tests (imported by name; fixtures live in conftest.py)."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from typing import Iterator

GIB_KB = 1024 * 1024  # sysfs meminfo is in kB


def make_sysfs(root: Path, nodes: list[tuple[str, int, int]], distances: list[list[int]]) -> Path:
    """nodes: (cpulist, total GiB, free GiB) per node."""
    base = root / "sys/devices/system/node"
    for node, (cpulist, total_gib, free_gib) in enumerate(nodes):
        d = base / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "distance").write_text(" ".join(map(str, distances[node])) + "\n")
        (d / "meminfo").write_text(
            f"Node {node} MemTotal:       {total_gib * GIB_KB} kB\n"
            f"Node {node} MemFree:        {free_gib * GIB_KB} kB\n"
            f"Node {node} MemUsed:        {(total_gib - free_gib) * GIB_KB} kB\n"
            f"Node {node} FilePages:      0 kB\n"
            f"Node {node} Shmem:          0 kB\n")
    (base / "online").write_text(f"0-{len(nodes) - 1}\n")
    return root


def copy_store(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def run_cli(argv, capsys):
    """Run ``bigmem argv`` in-process; return (exit code, stdout, stderr)."""
    from bigmem.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def poison_labels(value: int, voxel=(0, 0, 0)):
    """A mutate() for the corrupt_store fixture: set one label voxel of every case to ``value``."""

    def mutate(handle) -> None:
        for case in handle["cases"]:
            data = handle[f"cases/{case}/label"]
            values = data[...]
            values[voxel] = value
            data[...] = values

    return mutate


def save_nifti(path: Path, data, affine=None) -> Path:
    """Write ``data`` as a NIfTI file (identity affine unless given); returns ``path``."""
    import nibabel as nib
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), str(path))
    return path


def make_kits(root: Path, cases: dict) -> Path:
    """KiTS case folders: ``{case_id: (shape, label values or None for a test case)}``, e.g.
    ``{"case_00000": ((20, 24, 16), (0, 1, 2))}``; each label holds its values in blocks, the image
    is CT-like noise brighter where the label is. Returns ``root``."""
    import numpy as np

    rng = np.random.default_rng(len(cases))
    for case_id, (shape, values) in cases.items():
        label = np.zeros(shape, np.uint8)
        for index, value in enumerate(values or ()):
            label[2 + 2 * index:6 + 2 * index, 3:9, 2:7] = value
        image = (rng.normal(-100, 30, shape) + 80 * label).astype(np.float32)
        save_nifti(root / case_id / "imaging.nii.gz", image)
        if values is not None:
            save_nifti(root / case_id / "segmentation.nii.gz", label)
    return root


@contextlib.contextmanager
def slab_calls() -> Iterator[collections.Counter]:
    """The slab kernels entered inside the block, by kind (``SLAB_CALLS``'s increase; filled on exit).

    A slab test compares the slab path with the whole-tensor one; both pass if dispatch silently
    stopped partitioning, so the test also asserts on these counts.

    Example:
        >>> with slab_calls() as calls:
        ...     y = layer(x)
        >>> assert calls["conv3d"] > 0
    """
    from bigmem.nets.limits import SLAB_CALLS

    before = SLAB_CALLS.copy()
    calls: collections.Counter = collections.Counter()
    try:
        yield calls
    finally:
        calls.update(SLAB_CALLS - before)
