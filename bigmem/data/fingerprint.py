"""A store's dataset fingerprint: the per-case spacings and shapes nnU-Net v2's planner sets a network from.

nnU-Net's ``DatasetFingerprintExtractor`` (``nnunetv2/experiment_planning/dataset_fingerprint/
fingerprint_extractor.py``, ``analyze_case``) records each training case's spacing and its shape
after cropping to the nonzero box (``crop_to_nonzero``: the bounding box of the voxels that are
nonzero in any channel; its hole filling never moves the box). ``bigmem convert`` does not crop: a
store holds each case whole, in the canonical (RAS) orientation, resampled only with ``--spacing``
and fitted only with ``--shape``. So the shapes here are the stored ones, which bigmem trains on,
unless ``crop_to_nonzero`` asks for nnU-Net's (which reads every image once).

Axes are the store's: ``(D, H, W)``, its array axes, which are the canonical orientation's
``(x, y, z)``; the ``spacing`` attribute of each case is in the same order. nnU-Net reads the same
file's axes reversed (``z, y, x``), so its spacings and shapes are these reversed.
``bigmem.config.topology`` turns a fingerprint into the network's stages.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from bigmem.config.topology import Topology, median_shape, pool_and_kernels, target_spacing
from bigmem.data.store import HDF5VolumeStore
from bigmem.errors import DataError

Triple = tuple[int, int, int]


@dataclass(frozen=True)
class Fingerprint:
    """The cases of a store as the planner sees them: one spacing and one shape per case, in the store's axes.

    Attributes:
        case_ids: every case of the store (held-out ones too: nnU-Net plans from all training cases).
        spacings: each case's voxel spacing in mm, ``(D, H, W)``.
        shapes: each case's shape in voxels, ``(D, H, W)``: as stored, or its nonzero box (``cropped``).
        cropped: the shapes are the nonzero boxes (nnU-Net's ``shapes_after_crop``).
        resampled: convert resampled the cases (``--spacing``): the spacings are convert's target, not the
            source files' that nnU-Net would read.

    Example:
        >>> fp = Fingerprint(("a", "b"), ((1.0, 1.0, 1.0),) * 2, ((160, 192, 160), (150, 190, 150)), False, False)
        >>> fp.total_voxels, fp.topology().strides[1]
        (9190200, (2, 2, 2))
    """

    case_ids: tuple[str, ...]
    spacings: tuple[tuple[float, float, float], ...]
    shapes: tuple[Triple, ...]
    cropped: bool
    resampled: bool

    @property
    def num_cases(self) -> int:
        """The number of cases."""
        return len(self.case_ids)

    @property
    def total_voxels(self) -> int:
        """The voxels of every case, summed (at each case's own spacing)."""
        return int(sum(int(np.prod(shape, dtype=np.int64)) for shape in self.shapes))

    def target_spacing(self) -> tuple[float, float, float]:
        """nnU-Net's fullres target spacing of these cases (``topology.target_spacing``)."""
        return target_spacing(self.spacings, self.shapes)

    def median_shape(self) -> tuple[float, float, float]:
        """The median case at the target spacing (``topology.median_shape``)."""
        return median_shape(self.spacings, self.shapes, self.target_spacing())

    def dataset_voxels(self) -> float:
        """nnU-Net's estimate of the dataset's voxels at the target spacing: the median case's times the cases.

        What ``plan_experiment`` passes as ``approximate_n_voxels_dataset``, and ``topology.batch_cap`` takes.
        """
        return float(np.prod(self.median_shape(), dtype=np.float64) * self.num_cases)

    def topology(self) -> Topology:
        """The whole-median-case network: ``pool_and_kernels`` of ``median_shape`` at ``target_spacing``."""
        return pool_and_kernels(self.target_spacing(), self.median_shape())

    def to_json(self) -> dict:
        """The fingerprint as JSON, with nnU-Net's key names for the two lists (in the store's axis order)."""
        return {"case_ids": list(self.case_ids), "spacings": [list(s) for s in self.spacings],
                "shapes_after_crop" if self.cropped else "shapes": [list(s) for s in self.shapes],
                "cropped": self.cropped, "resampled": self.resampled, "total_voxels": self.total_voxels}


def nonzero_box(image: np.ndarray) -> Triple:
    """The shape of the bounding box of the voxels nonzero in any channel (nnU-Net's ``crop_to_nonzero`` box).

    Args:
        image: ``(D, H, W, C)`` or ``(D, H, W)``.

    Returns:
        The box's shape per axis; the whole shape where every voxel is zero (nothing to crop to).

    Example:
        >>> image = np.zeros((10, 12, 14, 1), np.float32); image[2:5, 3:9, 0:14] = 1.0
        >>> nonzero_box(image)
        (3, 6, 14)
    """
    mask = image != 0 if image.ndim == 3 else np.any(image != 0, axis=-1)
    box = []
    for axis in range(3):
        hits = np.flatnonzero(np.any(mask, axis=tuple(a for a in range(3) if a != axis)))
        box.append(int(hits[-1] - hits[0] + 1) if hits.size else int(mask.shape[axis]))
    return tuple(box)


def fingerprint(store: HDF5VolumeStore | str | os.PathLike, *, crop_to_nonzero: bool = False) -> Fingerprint:
    """The fingerprint of a store's cases: each one's ``spacing`` attribute and shape.

    Args:
        store: an open store or its path. Every case counts, held-out ones too.
        crop_to_nonzero: each shape is the case's nonzero box, as nnU-Net's fingerprint takes it
            (reads every image once, one case at a time); default False: the stored shapes, read
            from the layout alone.

    Returns:
        A ``Fingerprint``.

    Raises:
        DataError: the store cannot be opened, or a case has no ``spacing`` attribute of three
            positive numbers.

    Example:
        >>> fingerprint("kits.h5").topology().to_model_table()  # doctest: +SKIP
    """
    opened = store if isinstance(store, HDF5VolumeStore) else HDF5VolumeStore(store)
    try:
        cases = sorted([*opened.cases, *opened.held_out_cases], key=lambda case: case.case_id)
        handle = opened._handle()  # the store's own unit: its cases' attributes, as opened
        spacings = []
        for case in cases:
            spacing = tuple(float(s) for s in np.ravel(handle[f"cases/{case.case_id}"].attrs.get("spacing", ())))
            if len(spacing) != 3 or not all(np.isfinite(s) and s > 0 for s in spacing):
                raise DataError(f"Case {case.case_id!r}: spacing {spacing} in {str(opened.path)!r} is not three "
                                "positive numbers (mm); convert the dataset again.")
            spacings.append(spacing)
        if crop_to_nonzero:
            shapes = [nonzero_box(opened.read_case(case.case_id)[0]) for case in cases]
        else:
            shapes = [tuple(case.shape) for case in cases]
        options = json.loads(opened.root_attr("convert_options", "null") or "null") or {}
    finally:
        if opened is not store:
            opened.close()
    return Fingerprint(tuple(case.case_id for case in cases), tuple(spacings), tuple(shapes),
                       cropped=crop_to_nonzero, resampled=options.get("spacing") is not None)
