"""NIfTI sources: find the cases of a Medical Segmentation Decathlon folder (or two globs), and
load each in nibabel's closest canonical orientation (RAS), checked.

Both dataset.json conventions are read: MSD's (``"modality": {"0": "FLAIR"}``, ``"labels":
{"0": "background"}``) and nnU-Net v2's (``"channel_names"``, ``"labels": {"background": 0}``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigmem.errors import DataError

AFFINE_TOLERANCE_MM = 1e-3  # image and label affines may differ by float rounding, not by geometry
_NIFTI_SUFFIX = re.compile(r"(_\d{4})?\.nii(\.gz)?$")  # nnU-Net names channel files CASE_0000.nii.gz


@dataclass
class SourceCase:
    """One case to convert: its id and its image and label files."""

    case_id: str
    image: Path
    label: Path


@dataclass
class SourceDataset:
    """The cases of a source folder (or of two globs), with its channel and class names."""

    cases: list[SourceCase]
    channel_names: list[str]
    label_names: list[str]  # index = label value; values are 0..K-1
    origin: str
    declared_labels: bool = True  # False: label values come from the data (--images/--labels)
    problems: list[str] = field(default_factory=list)  # duplicate ids found while listing


def case_id_of(path: Path) -> str:
    """The case id of a NIfTI file: its name without ``.nii[.gz]`` and nnU-Net's ``_0000`` channel suffix."""
    return _NIFTI_SUFFIX.sub("", path.name)


def _label_table(labels: dict, where: str) -> list[str]:
    try:
        if all(str(k).lstrip("-").isdigit() for k in labels):  # MSD: {"0": "background"}
            table = {int(k): str(v) for k, v in labels.items()}
        else:  # nnU-Net v2: {"background": 0}
            table = {int(v): str(k) for k, v in labels.items()}
    except (TypeError, ValueError):
        raise DataError(f"{where}: 'labels' must map label values to names.") from None
    if sorted(table) != list(range(len(table))):
        raise DataError(f"{where}: label values {sorted(table)} are not 0..{len(table) - 1}; bigmem needs consecutive "
                        "labels (remap them, e.g. BraTS 4 -> 3, before converting).")
    return [table[v] for v in range(len(table))]


def read_msd(src: str | Path) -> SourceDataset:
    """The training cases listed by an MSD folder's dataset.json (or that file itself).

    Args:
        src: the folder holding dataset.json, imagesTr/ and labelsTr/, or dataset.json itself.

    Returns:
        A ``SourceDataset`` with declared channel and label names; a case id listed twice is
        kept once and reported in ``problems``.

    Raises:
        DataError: no or unreadable dataset.json, labels that are not 0..K-1, a training entry
            without image or label, or no training cases.

    Example:
        >>> dataset = read_msd("Task01_BrainTumour")
        >>> dataset.channel_names, len(dataset.cases)  # (['FLAIR', 'T1w', 't1gd', 'T2w'], 484)
    """
    src = Path(src)
    json_path = src / "dataset.json" if src.is_dir() else src
    if not json_path.is_file():
        raise DataError(f"No dataset.json in {str(src)!r}: expected a Medical Segmentation Decathlon folder "
                        "(dataset.json, imagesTr/, labelsTr/) or --images/--labels globs.")
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"Cannot read {json_path}: {exc}") from None
    root = json_path.parent
    channels = meta.get("channel_names") or meta.get("modality") or {"0": "image"}
    channel_names = [str(channels[k]) for k in sorted(channels, key=lambda k: int(k))]
    label_names = _label_table(meta.get("labels") or {}, str(json_path))
    cases, seen, problems = [], set(), []
    for entry in meta.get("training", []):
        try:
            image, label = root / entry["image"], root / entry["label"]
        except (TypeError, KeyError):
            raise DataError(f"{json_path}: each 'training' entry needs 'image' and 'label'.") from None
        case_id = case_id_of(image)
        if case_id in seen:
            problems.append(f"Case {case_id!r}: listed twice in {json_path}.")
            continue
        seen.add(case_id)
        cases.append(SourceCase(case_id, image, label))
    if not cases and not problems:
        raise DataError(f"{json_path} lists no training cases.")
    return SourceDataset(cases, channel_names, label_names, str(json_path), True, problems)


def read_globs(images: str, labels: str) -> SourceDataset:
    """Cases from two globs, paired by case id (the file name without .nii[.gz] and _0000).

    Args:
        images: a glob of image files, e.g. ``"imagesTr/*.nii.gz"``.
        labels: a glob of label files.

    Returns:
        A ``SourceDataset`` whose classes come from the data (``declared_labels=False``); an
        image without a label, or a case id matched twice, is reported in ``problems``.

    Raises:
        DataError: ``images`` matches no file.
    """
    image_paths = sorted(Path(p) for p in glob.glob(images))
    label_paths = {case_id_of(Path(p)): Path(p) for p in glob.glob(labels)}
    if not image_paths:
        raise DataError(f"--images {images!r} matches no file.")
    cases, seen, problems = [], set(), []
    for image in image_paths:
        case_id = case_id_of(image)
        if case_id in seen:
            problems.append(f"Case {case_id!r}: two images match --images ({image}).")
            continue
        seen.add(case_id)
        if case_id not in label_paths:
            problems.append(f"Case {case_id!r}: no label matches --labels {labels!r} for {image}.")
            continue
        cases.append(SourceCase(case_id, image, label_paths[case_id]))
    return SourceDataset(cases, ["image"], [], f"--images {images} --labels {labels}", False, problems)


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, as hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class LoadedCase:
    """One case in memory, in canonical orientation, checked: image, label and geometry."""

    case_id: str
    image: np.ndarray  # (D, H, W, C) float32, canonical (RAS) orientation
    label: np.ndarray  # (D, H, W) uint8, canonical
    affine: np.ndarray  # canonical affine
    source_affine: np.ndarray
    source_shape: tuple[int, ...]
    spacing: tuple[float, float, float]


def _load(path: Path, case_id: str, what: str):
    import nibabel as nib

    if not path.is_file():
        raise DataError(f"Case {case_id!r}: {what} file {str(path)!r} does not exist.")
    try:
        img = nib.load(str(path))
        canonical = nib.as_closest_canonical(img)
        data = np.asanyarray(canonical.dataobj)
    except Exception as exc:  # nibabel raises many types for a truncated or corrupt file
        raise DataError(f"Case {case_id!r}: cannot read {what} {str(path)!r} ({type(exc).__name__}: {exc}); the file "
                        "may be truncated or not NIfTI.") from None
    return img, canonical, data


@dataclass
class LoadedImage:
    """One image in memory, in canonical orientation, checked, with its geometry (no label)."""

    image: np.ndarray  # (D, H, W, C) float32, canonical (RAS) orientation
    affine: np.ndarray  # canonical affine
    source_affine: np.ndarray
    source_shape: tuple[int, ...]  # as the file has it (4D images keep their channel axis)
    spacing: tuple[float, float, float]


def load_image(path: Path, case_id: str, *, num_channels: int | None = None) -> LoadedImage:
    """Load one image file (3D, or 4D with channels last) in canonical orientation, checked.

    Args:
        path: a NIfTI file.
        case_id: the case's id, for messages.
        num_channels: the number of channels expected, or None to accept any.

    Returns:
        A ``LoadedImage`` whose ``image`` is ``(D, H, W, C)`` float32 in the closest canonical (RAS)
        orientation, with the canonical and the file's affines, the file's shape and the voxel spacing.

    Raises:
        DataError: the file is missing or unreadable, not 3D/4D, has another number of channels,
            or holds NaN/Inf.

    Example:
        >>> loaded = load_image(Path("imagesTs/case_001.nii.gz"), "case_001", num_channels=1)
        >>> loaded.image.shape  # (D, H, W, 1)
    """
    image_img, image_canonical, image = _load(path, case_id, "image")
    if image.ndim == 3:
        image = image[..., np.newaxis]
    if image.ndim != 4:
        raise DataError(f"Case {case_id!r}: image has {image.ndim} dimensions ({path}); expected 3 or 4.")
    if num_channels is not None and image.shape[3] != num_channels:
        raise DataError(f"Case {case_id!r}: image has {image.shape[3]} channels; dataset.json names "
                        f"{num_channels} ({path}).")
    image = np.asarray(image, dtype=np.float32)
    bad = int(np.count_nonzero(~np.isfinite(image)))
    if bad:
        raise DataError(f"Case {case_id!r}: image has {bad} non-finite values (NaN/Inf) ({path}).")
    zooms = tuple(float(z) for z in image_canonical.header.get_zooms()[:3])
    return LoadedImage(image, np.asarray(image_canonical.affine, np.float64), np.asarray(image_img.affine, np.float64),
                       tuple(int(s) for s in image_img.shape), zooms)


def load_case(case: SourceCase, *, num_channels: int | None, label_values: int | None) -> LoadedCase:
    """Load one case in canonical orientation, checking what can be checked.

    Args:
        case: the case's files.
        num_channels: the channels expected, or None to accept any.
        label_values: the number of classes expected (values 0..N-1), or None for any uint8.

    Returns:
        A ``LoadedCase``: image ``(D, H, W, C)`` float32 and label ``(D, H, W)`` uint8 in the
        closest canonical (RAS) orientation, the canonical and source affines, the source
        shape and the voxel spacing in mm.

    Raises:
        DataError: a file is missing or unreadable; the image is not 3D/4D or has the wrong
            channel count or NaN/Inf; the label is not 3D, has another shape or grid than the
            image, or holds non-integer, negative, undeclared or > 255 values.
    """
    loaded = load_image(case.image, case.case_id, num_channels=num_channels)
    image = loaded.image
    label_img, _, label = _load(case.label, case.case_id, "label")
    if label.ndim == 4 and label.shape[3] == 1:
        label = label[..., 0]
    if label.ndim != 3:
        raise DataError(f"Case {case.case_id!r}: label has shape {label.shape} ({case.label}); expected a 3D label "
                        "map (one integer per voxel), not a 4D file.")
    if label.shape != image.shape[:3]:  # reported as the files have them, not as reoriented
        raise DataError(f"Case {case.case_id!r}: label shape {tuple(label_img.shape[:3])} != image shape "
                        f"{tuple(loaded.source_shape[:3])} ({case.label}).")
    if not np.allclose(loaded.source_affine, label_img.affine, atol=AFFINE_TOLERANCE_MM):
        worst = float(np.abs(loaded.source_affine - label_img.affine).max())
        raise DataError(f"Case {case.case_id!r}: label affine differs from the image affine by {worst:.3g} "
                        f"(tolerance {AFFINE_TOLERANCE_MM}) ({case.label}); the two are not on the same grid.")
    if not np.all(np.isfinite(label)) or np.any(label != np.round(label)):
        raise DataError(f"Case {case.case_id!r}: label has non-integer values ({case.label}).")
    values = np.unique(label).astype(np.int64)
    if values.min() < 0 or (label_values is not None and values.max() >= label_values):
        allowed = f"0..{label_values - 1}" if label_values is not None else "0..255"
        wrong = [int(v) for v in values if v < 0 or (label_values is not None and v >= label_values)]
        raise DataError(f"Case {case.case_id!r}: label values {wrong} are not in dataset.json's labels ({allowed}) "
                        f"({case.label}).")
    if values.max() > 255:
        raise DataError(f"Case {case.case_id!r}: label value {int(values.max())} does not fit uint8 ({case.label}).")
    return LoadedCase(case.case_id, image, label.astype(np.uint8), loaded.affine, loaded.source_affine,
                      loaded.source_shape, loaded.spacing)
