"""NIfTI sources: the cases to convert, a dataset.json read and checked, and each case loaded in
nibabel's closest canonical orientation (RAS), checked. Which files make a case is the folder
layout's business (``bigmem/data/layouts.py``).

Both dataset.json conventions are read: MSD's (``"modality": {"0": "FLAIR"}``, ``"labels":
{"0": "background"}``) and nnU-Net v2's (``"channel_names"``, ``"labels": {"background": 0}``, and
its regions: ``"labels": {"background": 0, "whole_tumor": [1, 2, 3], "enhancing_tumor": 3}``, with
``"regions_class_order"`` for the label value the label files hold for each region).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from bigmem.errors import DataError

AFFINE_TOLERANCE_MM = 1e-3  # image and label affines may differ by float rounding, not by geometry
_NIFTI_SUFFIX = re.compile(r"(_\d{4})?\.nii(\.gz)?$")  # nnU-Net names channel files CASE_0000.nii.gz


@dataclass
class SourceCase:
    """One case to convert: its id, its image file(s) and its label file.

    ``image`` is one 3D or 4D (channels last) file, or a list of 3D files, one per channel in
    channel order (nnU-Net v2's ``CASE_0000.nii.gz``, ``CASE_0001.nii.gz``, ...).
    """

    case_id: str
    image: Path | list[Path]
    label: Path

    @property
    def image_files(self) -> list[Path]:
        """The image files as a list: ``[image]`` for one file, else the channel files in order."""
        return [Path(p) for p in self.image] if isinstance(self.image, (list, tuple)) else [Path(self.image)]

    @property
    def image_text(self) -> str:
        """The image file(s) as messages name them: the path, or the channel files' paths joined by ', '."""
        return ", ".join(map(str, self.image_files))


@dataclass
class SourceDataset:
    """The cases of a source folder (or of two globs), with its channel and class names.

    ``layout`` is the folder's layout (``bigmem.data.layouts.Layout``; "" for --images/--labels);
    ``regions`` maps nnU-Net region names to the label values they unite (``{}``: plain classes);
    ``notes`` are lines to show before converting (test cases skipped, a glob that matches one
    channel of several). With ``min_classes``, the store has at least that many classes and the
    later names of ``label_names`` only where a case's label holds their values (KiTS's cyst).
    ``channels_from`` and ``labels_from`` say who declared the channels and labels, for messages.
    """

    cases: list[SourceCase]
    channel_names: list[str]
    label_names: list[str]  # index = label value; values are 0..K-1
    origin: str
    declared_labels: bool = True  # False: label values come from the data (--images/--labels)
    problems: list[str] = field(default_factory=list)  # duplicate ids found while listing
    layout: str = ""
    regions: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    min_classes: int | None = None
    channels_from: str = "dataset.json names"
    labels_from: str = "dataset.json's labels"


def case_id_of(path: Path) -> str:
    """The case id of a NIfTI file: its name without ``.nii[.gz]`` and nnU-Net's ``_0000`` channel suffix."""
    return _NIFTI_SUFFIX.sub("", path.name)


def _label_table(labels, where: str) -> list[str]:
    example = '{"0": "background", "1": "tumour"} (MSD) or {"background": 0, "tumour": 1} (nnU-Net v2)'
    if not isinstance(labels, dict):
        raise DataError(f"{where}: 'labels' must map label values to names, such as {example}; got "
                        f"{_kind(labels)}.")
    try:
        if all(str(k).lstrip("-").isdigit() for k in labels):  # MSD: {"0": "background"}
            table = {int(k): _name(v) for k, v in labels.items()}
        else:  # nnU-Net v2: {"background": 0}
            table = {_value(v): str(k) for k, v in labels.items()}
    except (TypeError, ValueError):
        raise DataError(f"{where}: 'labels' must map label values to names, such as {example}.") from None
    if len(table) < 2:
        raise DataError(f"{where}: 'labels' names {len(table)} class{'' if len(table) == 1 else 'es'}; expected "
                        f"background and at least one more, such as {example}.")
    if sorted(table) != list(range(len(table))):
        raise DataError(f"{where}: label values {sorted(table)} are not 0..{len(table) - 1}; bigmem needs consecutive "
                        "labels (remap them, e.g. BraTS 4 -> 3, before converting).")
    return [table[v] for v in range(len(table))]


def _region_table(labels, where: str) -> tuple[list[str], dict[str, list[int]]] | None:
    """nnU-Net v2's region labels, or None where no label value is a list (then they are classes).

    As nnU-Net v2 reads them, once one entry is a list every entry but background (0) is a region,
    a single value standing for its one-element list. The label values are then 0..the largest
    region value, named ``class<N>`` (a region dataset names regions, not values).
    """
    if not isinstance(labels, dict) or not any(isinstance(v, list) for v in labels.values()):
        return None
    background, regions = None, {}
    for name, value in labels.items():
        values = [value] if isinstance(value, int) else value
        if not (isinstance(values, list) and values and all(isinstance(v, int) and not isinstance(v, bool)
                                                            and 0 <= v <= 255 for v in values)):
            raise DataError(f"{where}: label {name!r} is {json.dumps(value)}; expected a label value 0..255 or, "
                            'for a region, a list of them, such as {"background": 0, "whole_tumor": [1, 2, 3], '
                            '"tumor_core": [2, 3], "enhancing_tumor": 3}.')
        if values == [0]:
            background = str(name)
        elif 0 in values:
            raise DataError(f"{where}: region {name!r} holds label 0 ({json.dumps(value)}); background belongs to no "
                            "region.")
        else:
            regions[str(name)] = sorted(set(values))
    if background is None:
        raise DataError(f"{where}: 'labels' defines regions but no background (a label with value 0), such as "
                        '{"background": 0, "whole_tumor": [1, 2, 3]}.')
    largest = max(v for values in regions.values() for v in values) if regions else 0
    return [background] + [f"class{v}" for v in range(1, largest + 1)], regions


def region_classes(background: str, regions: dict[str, list[int]], order, where: str) -> list[str]:
    """The classes bigmem trains for nnU-Net v2 regions, from their ``regions_class_order``.

    nnU-Net v2 paints region i of ``labels`` (in its order) with the label value ``order[i]``, so
    the label files hold the values 0..K-1 (K = the regions + background); bigmem trains those as K
    softmax classes, class v named after the region painted v, and scores the regions from them.

    Args:
        background: the name of label 0.
        regions: region name -> the label values it unites, in the order of ``labels``.
        order: dataset.json's ``regions_class_order`` (None where it has none).
        where: the dataset.json, for messages.

    Returns:
        The class names in label-value order: ``[background, region painted 1, region painted 2, ...]``.

    Raises:
        DataError: no ``order``; an ``order`` that is not 1..K-1, one value per region; or a region
            whose values are not among 1..K-1, or that does not hold the value it is painted with;
            each message says how to map them (add regions_class_order, or give each label a
            single value).

    Example:
        >>> region_classes("background", {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]},
        ...                [1, 2, 3], "dataset.json")
        ['background', 'whole_tumor', 'tumor_core', 'enhancing_tumor']
    """
    shown = "; ".join(f"{name}: {values}" for name, values in regions.items())
    if order is None:
        raise DataError(f"{where}: 'labels' gives regions ({shown}) but no 'regions_class_order'; add "
                        "\"regions_class_order\" (the label value the label files hold for each region, in the order "
                        "of 'labels', as nnU-Net v2 writes it), or give each label a single value.")
    num_classes = len(regions) + 1
    if (not isinstance(order, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in order)
            or sorted(order) != list(range(1, num_classes))):
        raise DataError(f"{where}: 'regions_class_order' {json.dumps(order)} is not the label values "
                        f"1..{num_classes - 1}, one per region ({shown}); bigmem trains the label files' values "
                        f"0..{num_classes - 1} as classes: remap the label files, or give each label a single value.")
    for (name, values), painted in zip(regions.items(), order):
        outside = [v for v in values if not 0 < v < num_classes]
        if outside or painted not in values:
            why = (f"label values {outside} are not among the label files' 1..{num_classes - 1}" if outside
                   else f"it does not hold {painted}, its regions_class_order value")
            raise DataError(f"{where}: region {name!r} {values}: {why} (regions_class_order {order}); map each "
                            "region to the label values its class order paints, or give each label a single value.")
    names = [background] + [""] * len(regions)
    for name, painted in zip(regions, order):
        names[painted] = name
    return names


def _kind(value) -> str:
    """'a list', 'a string', ... for messages about a JSON value of the wrong type."""
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false",
             type(None): "null", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _name(value) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise TypeError(value)
    return str(value)


def _value(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):  # nnU-Net's regions ([1, 2, 3]) are not classes
        raise TypeError(value)
    return value


def _channel_table(channels, where: str, key: str) -> list[str]:
    """``key`` ('modality' or 'channel_names': {"0": "FLAIR", "1": "T1w"}) -> names in channel order."""
    example = '{"0": "FLAIR", "1": "T1w"}'
    if not isinstance(channels, dict) or not channels:
        raise DataError(f"{where}: '{key}' must map channel indices to names, such as {example}; got "
                        f"{_kind(channels) if channels != {} else 'an empty object'}.")
    if not all(isinstance(k, str) and k.isdigit() for k in channels):
        keys = ", ".join(repr(k) for k in list(channels)[:3])
        raise DataError(f"{where}: '{key}' must be keyed by channel index (\"0\", \"1\", ...), such as {example}; "
                        f"got keys {keys}.")
    table = {int(k): v for k, v in channels.items()}
    if sorted(table) != list(range(len(table))):
        raise DataError(f"{where}: '{key}' channel indices {sorted(table)} are not 0..{len(table) - 1}.")
    if not all(isinstance(v, str) for v in table.values()):
        raise DataError(f"{where}: '{key}' must map channel indices to names (strings), such as {example}.")
    return [table[i] for i in range(len(table))]


def _json_object(json_path: Path) -> dict:
    """dataset.json's object: refused when unreadable, a NIfTI file given by mistake, not UTF-8 JSON or no object."""
    where = str(json_path)
    try:
        raw = json_path.read_bytes()
    except OSError as exc:
        raise DataError(f"Cannot read {where}: {exc.strerror or exc}.") from None
    if raw[:2] == b"\x1f\x8b" or json_path.name.endswith((".nii", ".nii.gz")):
        raise DataError(f"{where} is a NIfTI (or gzip) file, not a dataset.json: give the MSD folder (dataset.json, "
                        "imagesTr/, labelsTr/) or its dataset.json, or {convert.images}/{convert.labels} globs for "
                        "loose files.")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"Cannot read {where}: not UTF-8 text; expected a dataset.json (JSON).") from None
    except ValueError as exc:
        raise DataError(f"Cannot read {where}: not valid JSON ({exc}).") from None
    if not isinstance(meta, dict):
        raise DataError(f"{where}: expected a JSON object with 'modality' (or 'channel_names'), 'labels' and "
                        f"'training'; got {_kind(meta)}.")
    return meta


def _training_pairs(training, where: str) -> list[tuple[str, str]]:
    """dataset.json's ``training`` entries as (image, label) paths, each checked."""
    if not isinstance(training, list):
        raise DataError(f"{where}: 'training' must be a list of {{\"image\": ..., \"label\": ...}} entries; got "
                        f"{_kind(training)}.")
    pairs = []
    for number, entry in enumerate(training, 1):
        if not (isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("image", "label"))):
            raise DataError(f"{where}: each 'training' entry needs 'image' and 'label' paths (entry {number}: "
                            f"{json.dumps(entry)[:80]}).")
        pairs.append((entry["image"], entry["label"]))
    return pairs


def _test_images(test, where: str) -> list[str]:
    """dataset.json's ``test`` entries as image paths (a path, or an entry with ``image``), each checked."""
    if not isinstance(test, list):
        raise DataError(f"{where}: 'test' must be a list of image paths; got {_kind(test)}.")
    images = []
    for number, entry in enumerate(test, 1):
        image = entry.get("image") if isinstance(entry, dict) else entry
        if not isinstance(image, str):
            raise DataError(f"{where}: each 'test' entry must be an image path (entry {number}: "
                            f"{json.dumps(entry)[:80]}).")
        images.append(image)
    return images


def read_dataset_json(json_path: str | Path) -> dict:
    """Read and check an MSD / nnU-Net v2 dataset.json: the one loader every reader of it uses.

    Args:
        json_path: the dataset.json file.

    Returns:
        ``{"channel_names": [...], "label_names": [...], "regions": {...}, "regions_class_order": [...] | None,
        "training": [(image, label), ...], "has_training": bool, "has_channel_names": bool, "test": [image, ...],
        "file_ending": str, "num_training": int | None}``: names in channel and label-value order; nnU-Net v2's regions
        (``{name: [label values]}``; ``{}`` where the labels are classes; with regions the values are
        named ``class<N>``) and their ``regions_class_order`` as written (``region_classes`` checks it
        and names the classes bigmem trains); each training entry's two paths and each test image as
        written (relative to the file's folder); whether a ``training`` list is there at all (MSD
        lists its cases, nnU-Net v2 does not) and whether ``channel_names`` is (nnU-Net v2's name for
        MSD's ``modality``); nnU-Net v2's ``file_ending`` (default ".nii.gz") and ``numTraining``.

    Raises:
        DataError: the file is unreadable, not UTF-8 JSON (a NIfTI file given by mistake is named
            as one), not a JSON object, or its ``modality``/``channel_names``, ``labels`` (regions
            included), ``training``, ``test`` or ``file_ending`` are not of the documented form.

    Example:
        >>> read_dataset_json("Task01_BrainTumour/dataset.json")["channel_names"]  # ['FLAIR', 'T1w', ...]
    """
    json_path = Path(json_path)
    where = str(json_path)
    meta = _json_object(json_path)
    if meta.get("channel_names") is not None:
        channel_names = _channel_table(meta["channel_names"], where, "channel_names")
    elif meta.get("modality") is not None:
        channel_names = _channel_table(meta["modality"], where, "modality")
    else:
        channel_names = ["image"]
    label_names, regions = None, {}
    if "labels" in meta:
        label_names, regions = _region_table(meta["labels"], where) or (_label_table(meta["labels"], where), {})
    if label_names is None:
        raise DataError(f"{where} has no 'labels': expected label values mapped to names, such as "
                        '{"0": "background", "1": "tumour"}.')
    pairs, images = _training_pairs(meta.get("training", []), where), _test_images(meta.get("test", []), where)
    ending = meta.get("file_ending", ".nii.gz")
    if not isinstance(ending, str) or not ending.endswith((".nii", ".nii.gz")):
        raise DataError(f"{where}: 'file_ending' is {json.dumps(ending)}; bigmem reads NIfTI files (\".nii.gz\" or "
                        "\".nii\"): convert the images to NIfTI first.")
    count = meta.get("numTraining")
    return {"channel_names": channel_names, "label_names": label_names, "regions": regions,
            "regions_class_order": meta.get("regions_class_order"), "training": pairs,
            "has_training": "training" in meta, "has_channel_names": "channel_names" in meta, "test": images,
            "file_ending": ending,
            "num_training": count if isinstance(count, int) and not isinstance(count, bool) else None}


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
        img = nib.load(str(path))  # the header only: the voxels are read below
    except Exception as exc:  # nibabel raises many types for a truncated or corrupt file
        raise DataError(f"Case {case_id!r}: cannot read {what} {str(path)!r} ({type(exc).__name__}: {exc}); the file "
                        "may be truncated or not NIfTI.") from None
    check_header_size(img, case_id, what, path)
    try:
        canonical = nib.as_closest_canonical(img)
        data = np.asanyarray(canonical.dataobj)
    except MemoryError:
        raise DataError(f"Case {case_id!r}: ran out of memory reading {what} {str(path)!r} (shape "
                        f"{tuple(img.shape)}).") from None
    except Exception as exc:  # nibabel raises many types for a truncated or corrupt file
        raise DataError(f"Case {case_id!r}: cannot read {what} {str(path)!r} ({type(exc).__name__}: {exc}); the file "
                        "may be truncated or not NIfTI.") from None
    return img, canonical, data


def check_header_size(img, case_id: str, what: str, path: Path) -> None:
    """Raise ``DataError`` when ``img``'s header claims more voxels than this machine could hold.

    Called before the voxels are read (a corrupt header claiming 30000^3 would otherwise end in
    a MemoryError). ``img`` is a ``nibabel`` image as ``nib.load`` returns it (header only).
    """
    import psutil

    from bigmem.units import format_bytes

    shape = tuple(int(s) for s in img.shape)
    voxels = int(np.prod(shape, dtype=object))  # exact: a corrupt header's product can pass 2^63
    # the smallest array loading makes: the file's dtype, or float32 (load_image's copy) if smaller
    needed = voxels * max(np.dtype(img.get_data_dtype()).itemsize, 4)
    available = int(psutil.virtual_memory().available)
    if needed > available:
        raise DataError(f"Case {case_id!r}: {what} header claims shape {shape} ({voxels:.3g} voxels, "
                        f"{format_bytes(needed)} in memory), more than this machine's available memory "
                        f"({format_bytes(available)}) ({path}); the header may be corrupt, or the case is too "
                        "large to load here.")


@dataclass
class LoadedImage:
    """One image in memory, in canonical orientation, checked, with its geometry (no label)."""

    image: np.ndarray  # (D, H, W, C) float32, canonical (RAS) orientation
    affine: np.ndarray  # canonical affine
    source_affine: np.ndarray
    source_shape: tuple[int, ...]  # as the file has it (4D images keep their channel axis)
    spacing: tuple[float, float, float]


def load_image(path: Path, case_id: str, *, num_channels: int | None = None,
               channels_from: str = "dataset.json names") -> LoadedImage:
    """Load one image file (3D, or 4D with channels last) in canonical orientation, checked.

    Args:
        path: a NIfTI file.
        case_id: the case's id, for messages.
        num_channels: the number of channels expected, or None to accept any.
        channels_from: who expects ``num_channels``, for the message: "Case 'x': image has 2
            channels; {channels_from} 1" (default "dataset.json names").

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
        raise DataError(f"Case {case_id!r}: image has {image.shape[3]} channels; {channels_from} "
                        f"{num_channels} ({path}).")
    image = np.asarray(image, dtype=np.float32)
    bad = int(np.count_nonzero(~np.isfinite(image)))
    if bad:
        raise DataError(f"Case {case_id!r}: image has {bad} non-finite values (NaN/Inf) ({path}).")
    zooms = tuple(float(z) for z in image_canonical.header.get_zooms()[:3])
    return LoadedImage(image, np.asarray(image_canonical.affine, np.float64), np.asarray(image_img.affine, np.float64),
                       tuple(int(s) for s in image_img.shape), zooms)


def load_channels(paths: Sequence[str | Path], case_id: str, *, num_channels: int | None = None,
                  channels_from: str = "dataset.json names") -> LoadedImage:
    """Load a case's image: one 3D/4D file, or one 3D file per channel (nnU-Net's CASE_0000, CASE_0001, ...).

    Args:
        paths: the image file, or the channel files in channel order.
        case_id: the case's id, for messages.
        num_channels: the number of channels expected, or None to accept any.
        channels_from: who expects ``num_channels``, for the message (as ``load_image``'s).

    Returns:
        A ``LoadedImage`` as ``load_image`` gives it; with several files, ``image`` holds them as
        channels ``(D, H, W, len(paths))`` and the geometry is the first file's.

    Raises:
        DataError: as ``load_image``; or one of several files has more than one channel, or is not
            on the first file's grid (shape and affine).

    Example:
        >>> loaded = load_channels([Path("imagesTr/BraTS_001_0000.nii.gz"), Path("imagesTr/BraTS_001_0001.nii.gz")],
        ...                        "BraTS_001", num_channels=2)
        >>> loaded.image.shape  # (D, H, W, 2)
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError(f"Case {case_id!r}: no image file given; expected one 3D/4D file or one 3D file per channel.")
    if len(paths) == 1:
        return load_image(paths[0], case_id, num_channels=num_channels, channels_from=channels_from)
    if num_channels is not None and len(paths) != num_channels:
        raise DataError(f"Case {case_id!r}: {len(paths)} channel files; {channels_from} {num_channels} "
                        f"({', '.join(map(str, paths))}).")
    first, image = None, None
    for index, path in enumerate(paths):  # one channel at a time into the case's array: no second copy of it
        loaded = load_image(path, case_id)
        if loaded.image.shape[3] != 1:
            raise DataError(f"Case {case_id!r}: {path} has {loaded.image.shape[3]} channels; expected one 3D file "
                            "per channel when several files are given.")
        if first is None:
            first, image = loaded, np.empty(loaded.image.shape[:3] + (len(paths),), np.float32)
        elif loaded.source_shape != first.source_shape or not np.allclose(loaded.source_affine, first.source_affine,
                                                                          atol=AFFINE_TOLERANCE_MM):
            raise DataError(f"Case {case_id!r}: {path} is not on the grid of {paths[0]} (shape "
                            f"{loaded.source_shape} vs {first.source_shape}, or a different affine).")
        image[..., index] = loaded.image[..., 0]
    first.image = image
    return first


def load_case(case: SourceCase, *, num_channels: int | None, label_values: int | None,
              channels_from: str = "dataset.json names", labels_from: str = "dataset.json's labels") -> LoadedCase:
    """Load one case in canonical orientation, checking what can be checked.

    Args:
        case: the case's files (one image file, or one file per channel: ``load_channels``).
        num_channels: the channels expected, or None to accept any.
        label_values: the number of classes expected (values 0..N-1), or None for any uint8.
        channels_from, labels_from: who expects them, for messages (default: dataset.json; an
            --append names the store).

    Returns:
        A ``LoadedCase``: image ``(D, H, W, C)`` float32 and label ``(D, H, W)`` uint8 in the
        closest canonical (RAS) orientation, the canonical and source affines, the source
        shape and the voxel spacing in mm.

    Raises:
        DataError: a file is missing or unreadable; the image is not 3D/4D or has the wrong
            channel count or NaN/Inf (a channel file not 3D or not on the first's grid); the label
            is not 3D, has another shape or grid than the image, or holds non-integer, negative,
            undeclared or > 255 values.
    """
    loaded = load_channels(case.image_files, case.case_id, num_channels=num_channels, channels_from=channels_from)
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
        raise DataError(f"Case {case.case_id!r}: label values {wrong} are not in {labels_from} ({allowed}) "
                        f"({case.label}).")
    if values.max() > 255:
        raise DataError(f"Case {case.case_id!r}: label value {int(values.max())} does not fit uint8 ({case.label}).")
    return LoadedCase(case.case_id, image, label.astype(np.uint8), loaded.affine, loaded.source_affine,
                      loaded.source_shape, loaded.spacing)
