"""Where a store's voxels came from: map predictions between a store's grid and the source file's.

``bigmem convert`` takes a source file through three steps, and a case in the store keeps what
undoes each (``bigmem/data/convert.py``):

1. closest canonical (RAS) orientation (``source_affine``, ``source_shape``): a flip/permutation;
2. optionally ``--spacing`` resampling (``canonical_shape`` holds the resampled, pre-crop shape,
   ``affine`` that grid's affine): ``scipy.ndimage.zoom`` with ``grid_mode=True``, so the field of
   view's outer edges stay where they were and every voxel keeps its world position;
3. optionally a centre crop/pad to ``--shape`` (``crop_pad``: per axis ``(crop, pad)``).

``CaseGeometry`` holds these; ``scores_to_source`` and ``labels_to_source`` undo 3, 2, 1 in that
order, one class channel at a time, so a 512^3 x C float32 map needs the input, the output and a few
single-channel arrays, never a float64 copy. ``prepare_nifti`` does 1-3 for a file not in a store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from bigmem.data.store import HDF5VolumeStore
from bigmem.errors import DataError

if TYPE_CHECKING:
    from bigmem.infer.modelcard import ModelCard

RAS = np.array([[0, 1], [1, 1], [2, 1]], dtype=float)  # nibabel's orientation of a canonical array


def _read_only(array, dtype) -> np.ndarray:
    out = np.array(array, dtype=dtype)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class CaseGeometry:
    """How a case's store grid maps to its source file's grid.

    Args:
        case_id: the case's id, for messages.
        source_shape: the source file's spatial shape ``(X, Y, Z)``, as stored on disk.
        source_affine: the source file's 4x4 voxel-to-world affine (mm).
        grid_shape: the shape after canonical reorientation and resampling, before the crop/pad
            (convert's ``canonical_shape`` attribute); the canonical shape when not resampled.
        grid_affine: that grid's affine (convert's ``affine`` attribute).
        store_shape: the stored array's spatial shape ``(D, H, W)``.
        crop_pad: per axis ``(crop, pad)``: voxels cropped from the start of ``grid_shape``'s axis, or
            zeros padded before it (``bigmem.data.convert.centre_fit``); ``(0, 0)`` where neither.
        spacing: the store grid's voxel spacing (mm).
        source_label: the source label file convert read (the case's ``source_label`` attribute), or
            ``""`` where there is none (``bigmem synth``, a NIfTI file ``prepare_nifti`` prepared).

    Example:
        >>> geometry = CaseGeometry.from_store("kits19.h5", "case_00042")
        >>> geometry.source_shape, geometry.resampled
    """

    case_id: str
    source_shape: tuple[int, int, int]
    source_affine: np.ndarray
    grid_shape: tuple[int, int, int]
    grid_affine: np.ndarray
    store_shape: tuple[int, int, int]
    crop_pad: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    spacing: tuple[float, float, float]
    source_label: str = ""

    def __post_init__(self):
        set_ = object.__setattr__  # a frozen dataclass normalises its fields this way
        set_(self, "source_shape", tuple(int(s) for s in self.source_shape[:3]))
        set_(self, "grid_shape", tuple(int(s) for s in self.grid_shape))
        set_(self, "store_shape", tuple(int(s) for s in self.store_shape))
        set_(self, "crop_pad", tuple((int(c), int(p)) for c, p in self.crop_pad))
        set_(self, "spacing", tuple(float(s) for s in self.spacing))
        set_(self, "source_affine", _read_only(self.source_affine, np.float64))
        set_(self, "grid_affine", _read_only(self.grid_affine, np.float64))
        for axis, ((crop, pad), grid, store) in enumerate(zip(self.crop_pad, self.grid_shape, self.store_shape)):
            if crop < 0 or pad < 0 or crop + min(grid, store) > grid or pad + min(grid, store) > store:
                raise DataError(f"Case {self.case_id!r}: crop_pad {self.crop_pad} does not fit axis {axis} (pre-crop "
                                f"size {grid}, stored size {store}); expected convert's centre_fit offsets.")

    # ---- derived -------------------------------------------------------------------------

    @property
    def source_orientation(self) -> np.ndarray:
        """nibabel's ``io_orientation`` of the source: the source -> canonical flip/permutation."""
        from nibabel.orientations import io_orientation

        return io_orientation(self.source_affine)

    @property
    def canonical_shape(self) -> tuple[int, int, int]:
        """The source's shape in closest canonical (RAS) orientation, before any resampling."""
        axes = self.source_orientation[:, 0].astype(int)
        shape = [0, 0, 0]
        for source_axis, canonical_axis in enumerate(axes):
            shape[canonical_axis] = self.source_shape[source_axis]
        return tuple(shape)

    @property
    def canonical_affine(self) -> np.ndarray:
        """The canonical grid's affine, as ``nibabel.as_closest_canonical`` gives it."""
        from nibabel.orientations import inv_ornt_aff

        return self.source_affine @ inv_ornt_aff(self.source_orientation, self.source_shape)

    @property
    def resampled(self) -> bool:
        """Whether convert resampled the case (``--spacing`` changed its shape or its affine)."""
        return self.grid_shape != self.canonical_shape or not np.allclose(self.grid_affine, self.canonical_affine,
                                                                          atol=1e-6)

    @property
    def lossless(self) -> bool:
        """Whether the store grid keeps every source voxel as it was: not resampled, nothing cropped away.

        Where it does, the store's label maps back to the source label voxel for voxel
        (``source_label_from_store``); convert's padding is dropped on the way back and loses nothing.
        """
        return not self.resampled and not any(crop for crop, _ in self.crop_pad)

    @property
    def store_affine(self) -> np.ndarray:
        """The stored array's own affine: ``grid_affine`` shifted by the crop/pad."""
        shift = np.eye(4)
        shift[:3, 3] = [crop - pad for crop, pad in self.crop_pad]
        return self.grid_affine @ shift

    @property
    def source_spacing(self) -> tuple[float, float, float]:
        """The source file's voxel sizes (mm), from its affine's columns."""
        from nibabel.affines import voxel_sizes

        return tuple(float(s) for s in voxel_sizes(self.source_affine))

    # ---- reading -------------------------------------------------------------------------

    @classmethod
    def from_store(cls, store: HDF5VolumeStore | str | os.PathLike, case_id: str) -> "CaseGeometry":
        """Read a case's geometry from a store written by ``bigmem convert``.

        Args:
            store: an open store or its path.
            case_id: the case.

        Returns:
            The case's ``CaseGeometry``.

        A case not written by ``bigmem convert`` (a ``bigmem synth`` phantom) has no source file:
        its geometry is its own grid (no crop, pad, resampling or reorientation; its ``affine``).

        Raises:
            DataError: the case is not in the store, or has only some of convert's attributes.

        Example:
            >>> geometry = CaseGeometry.from_store("brats.h5", "BRATS_001")
            >>> geometry.source_shape  # (240, 240, 155)
        """
        import h5py

        path = Path(store.path if isinstance(store, HDF5VolumeStore) else store)
        try:
            with h5py.File(path, "r") as handle:
                case = handle.get(f"cases/{case_id}")
                if case is None:
                    raise DataError(f"Case {case_id!r} is not in store {str(path)!r}.")
                attrs = dict(case.attrs)
                store_shape = case["label"].shape
        except OSError as exc:
            raise DataError(f"Cannot read case {case_id!r} from store {str(path)!r} ({exc}).") from None
        if not any(name in attrs for name in ("source_shape", "canonical_shape", "crop_pad")):
            # Not written by convert (``bigmem synth``): the store grid is the source grid.
            affine = np.asarray(attrs.get("affine", np.diag([*attrs.get("spacing", (1.0, 1.0, 1.0)), 1.0])))
            spacing = tuple(float(s) for s in attrs.get("spacing", np.linalg.norm(affine[:3, :3], axis=0)))
            return cls(case_id, tuple(store_shape), affine, tuple(store_shape), affine, tuple(store_shape),
                       ((0, 0),) * 3, spacing)
        missing = [name for name in ("source_shape", "source_affine", "canonical_shape", "affine", "crop_pad",
                                     "spacing") if name not in attrs]
        if missing:
            raise DataError(f"Case {case_id!r}: no {', '.join(missing)} attribute(s) in {path}:/cases/{case_id}; "
                            "expected a store written by 'bigmem convert' (a synthetic store has no source file "
                            "to map back to).")
        return cls(case_id, tuple(attrs["source_shape"]), attrs["source_affine"], tuple(attrs["canonical_shape"]),
                   attrs["affine"], tuple(store_shape), tuple(map(tuple, np.asarray(attrs["crop_pad"]))),
                   tuple(attrs["spacing"]), str(attrs.get("source_label", "")))


# ---- store grid -> source grid ----------------------------------------------------------


def _uncrop(channel: np.ndarray, geometry: CaseGeometry, fill) -> np.ndarray:
    """One store-grid channel placed back on the pre-crop grid; cropped-away voxels get ``fill``."""
    if geometry.store_shape == geometry.grid_shape and not any(c or p for c, p in geometry.crop_pad):
        return channel
    out = np.full(geometry.grid_shape, fill, dtype=channel.dtype)
    dst, src = [], []
    for (crop, pad), grid, store in zip(geometry.crop_pad, geometry.grid_shape, geometry.store_shape):
        n = min(grid, store)
        dst.append(slice(crop, crop + n))
        src.append(slice(pad, pad + n))
    out[tuple(dst)] = channel[tuple(src)]
    return out


def _unresample(channel: np.ndarray, geometry: CaseGeometry) -> np.ndarray:
    """Linear resampling of one float32 channel from the resampled grid back to the canonical one.

    The inverse of convert's ``ndimage.zoom(..., grid_mode=True)``: zoom ``canonical / resampled`` with
    ``grid_mode`` keeps the field of view's edges, so each canonical voxel reads the resampled grid at
    its own world position. ``mode="nearest"`` repeats the edge voxel over the half voxel past the last
    centre, so class scores still sum to 1 there (convert's ``grid-constant`` would fade them to 0).
    """
    from scipy import ndimage

    # ndimage.zoom's output shape is round(shape x zoom), here within float rounding of the target; with
    # grid_mode it then maps voxel centres by the shape ratio alone, exactly as convert's forward zoom did.
    zoom = np.asarray(geometry.canonical_shape, np.float64) / np.asarray(geometry.grid_shape, np.float64)
    out = ndimage.zoom(channel, zoom, output=np.float32, order=1, grid_mode=True, mode="nearest")
    if out.shape != geometry.canonical_shape:  # checked, not assumed
        raise DataError(f"Case {geometry.case_id!r}: resampling back gave shape {out.shape}, expected "
                        f"{geometry.canonical_shape}.")
    return out


def _reorient(array: np.ndarray, geometry: CaseGeometry) -> np.ndarray:
    """A canonical-orientation array as the source file lays it out (a view: flips and a transpose)."""
    from nibabel.orientations import apply_orientation, ornt_transform

    return apply_orientation(array, ornt_transform(RAS, geometry.source_orientation))


def _check_grid(array: np.ndarray, geometry: CaseGeometry, what: str, ndim: int) -> None:
    if array.ndim != ndim or tuple(array.shape[:3]) != geometry.store_shape:
        expected = geometry.store_shape + (("C",) if ndim == 4 else ())
        raise DataError(f"Case {geometry.case_id!r}: {what} has shape {tuple(array.shape)}; expected the store "
                        f"grid's {expected}.")


def _score_channels(scores: np.ndarray, geometry: CaseGeometry, regions: bool = False) -> Iterator[np.ndarray]:
    """Each class channel of ``scores`` mapped to the source grid (views where nothing is computed).

    What convert cropped away is background: probability 1 for class 0, 0 for the others; for region
    probabilities (``regions``) 0 for every region."""
    for c in range(scores.shape[3]):
        channel = _uncrop(scores[..., c], geometry, 1.0 if c == 0 and not regions else 0.0)
        if geometry.resampled:
            channel = _unresample(channel, geometry)
        yield _reorient(channel, geometry)


def scores_to_source(scores: np.ndarray, geometry: CaseGeometry, regions: bool = False) -> np.ndarray:
    """Map class scores from the store grid to the source file's grid.

    Undoes convert's crop/pad (voxels convert cropped away become background: probability 1 for
    class 0, 0 for the others, and 0 for every region of sigmoid region probabilities, ``regions``;
    convert's padding is dropped), its ``--spacing`` resampling (linear,
    per class) and its canonical reorientation, one class channel at a time: the peak is the input,
    the float32 output and a few single-channel arrays.

    Args:
        scores: ``(D, H, W, C)`` class probabilities on the store grid (``geometry.store_shape``).
            Probabilities, not logits: the background fill and the interpolation assume them.

    Returns:
        ``(*geometry.source_shape, C)`` float32, on the grid of ``geometry.source_affine``.

    Raises:
        DataError: ``scores`` is not ``(D, H, W, C)`` on the store grid.

    Example:
        >>> probs = scores_to_source(probs_store_grid, CaseGeometry.from_store("brats.h5", "BRATS_001"))
        >>> probs.shape  # (240, 240, 155, 4)
    """
    _check_grid(scores, geometry, "scores", 4)
    out = np.empty(geometry.source_shape + (scores.shape[3],), np.float32)
    for c, channel in enumerate(_score_channels(scores, geometry, regions)):
        out[..., c] = channel
    return out


def _unresample_labels(labels: np.ndarray, geometry: CaseGeometry) -> np.ndarray:
    """Nearest-neighbour resampling of a label map back to the canonical grid (as ``_unresample``, order 0)."""
    from scipy import ndimage

    zoom = np.asarray(geometry.canonical_shape, np.float64) / np.asarray(geometry.grid_shape, np.float64)
    out = ndimage.zoom(labels, zoom, order=0, grid_mode=True, mode="nearest")
    if out.shape != geometry.canonical_shape:
        raise DataError(f"Case {geometry.case_id!r}: resampling back gave shape {out.shape}, expected "
                        f"{geometry.canonical_shape}.")
    return out


def labels_to_source(scores_or_labels: np.ndarray, geometry: CaseGeometry,
                     region_order: Sequence[int] | None = None) -> np.ndarray:
    """A label map on the source file's grid, from store-grid class scores or a store-grid label map.

    Scores ``(D, H, W, C)`` are mapped class by class (as ``scores_to_source``, linear) and reduced by a
    running argmax, so the full ``(..., C)`` source-grid array never exists; ties go to the lower class,
    as ``np.argmax``. A label map ``(D, H, W)`` is mapped as labels: uncropped with 0, resampled back
    nearest-neighbour (the inverse of convert's own nearest resampling) and reoriented, exact when the
    case was not resampled. Nearest beat a linear one-hot resampling on convert's own labels: Dice
    0.989 against 0.982 for a 5,000-voxel blob at 0.9 -> 1.0 mm, 0.999 against 0.994 at 2.0/1.5/1.2 ->
    1.25 mm (``tests/infer/test_geometry.py`` shapes).

    With ``region_order`` the scores are sigmoid probabilities of nnU-Net regions: each is mapped back
    the same way, and region ``i`` paints the label value ``region_order[i]`` where its probability
    passes 0.5, later regions over earlier ones (nnU-Net's ``convert_probabilities_to_segmentation``
    with ``regions_class_order``).

    Args:
        scores_or_labels: ``(D, H, W, C)`` float probabilities, or ``(D, H, W)`` integer labels, on the
            store grid.
        geometry: the case's ``CaseGeometry``.
        region_order: the label value each region's channel paints (default None: softmax classes).

    Returns:
        ``geometry.source_shape`` uint8 labels on the grid of ``geometry.source_affine``.

    Raises:
        DataError: the array is not on the store grid, or has more than 256 classes.

    Example:
        >>> labels = labels_to_source(probs_store_grid, geometry)
        >>> nib.save(nib.Nifti1Image(labels, geometry.source_affine), "case_001.nii.gz")
    """
    if scores_or_labels.ndim == 3:
        _check_grid(scores_or_labels, geometry, "label map", 3)
        if scores_or_labels.size and int(scores_or_labels.max()) > 255:
            raise DataError(f"Case {geometry.case_id!r}: label value {int(scores_or_labels.max())} does not fit a "
                            "uint8 label map (at most 255).")
        labels = _uncrop(scores_or_labels.astype(np.uint8, copy=False), geometry, 0)
        if geometry.resampled:
            labels = _unresample_labels(labels, geometry)
        return np.ascontiguousarray(_reorient(labels, geometry))
    _check_grid(scores_or_labels, geometry, "scores", 4)
    if scores_or_labels.shape[3] > 256:
        raise DataError(f"Case {geometry.case_id!r}: {scores_or_labels.shape[3]} classes do not fit a uint8 label "
                        "map (at most 256).")
    mapped = _score_channels(scores_or_labels, geometry, region_order is not None)
    if region_order is not None:
        labels = np.zeros(geometry.source_shape, np.uint8)
        for value, channel in zip(region_order, mapped):
            labels[channel > 0.5] = value
        return labels
    best = np.array(next(mapped), dtype=np.float32)  # a copy: it is updated in place, and may view the input
    labels = np.zeros(geometry.source_shape, np.uint8)
    for c, channel in enumerate(mapped, start=1):
        better = channel > best
        labels[better] = c
        np.maximum(best, channel, out=best)
    return labels


def source_label_from_store(store: HDF5VolumeStore | str | os.PathLike, case_id: str):
    """A store case's label mapped back to its source file's grid (``bigmem evaluate`` with a store REF).

    Without ``--spacing`` the result is the source label voxel for voxel, except where convert's
    ``--shape`` cropped labels away (those voxels read 0). With ``--spacing`` the label went through a
    nearest-neighbour resampling and comes back through another: close (where convert downsampled, a
    dropped slice stays dropped), not exact.

    Args:
        store: an open store or its path.
        case_id: the case.

    Returns:
        ``(label, affine, spacing)``: ``source_shape`` uint8 labels, the source's 4x4 affine and its voxel
        sizes ``(sx, sy, sz)`` in mm.

    Raises:
        DataError: the case is not in the store or was not written by ``bigmem convert``.

    Example:
        >>> label, affine, spacing = source_label_from_store("kits19.h5", "case_00042")
        >>> label.shape  # the source labelsTr file's shape
    """
    geometry = CaseGeometry.from_store(store, case_id)
    opened = store if isinstance(store, HDF5VolumeStore) else HDF5VolumeStore(store)
    try:
        label = opened.read_label(case_id)
    finally:
        if opened is not store:
            opened.close()
    labels = labels_to_source(label, geometry)
    return labels, np.array(geometry.source_affine), geometry.source_spacing


# ---- a new NIfTI case, prepared as its store's were -------------------------------------


def prepare_nifti(image_paths: str | os.PathLike | Sequence[str | os.PathLike],
                  card: "ModelCard | HDF5VolumeStore | str | os.PathLike", case_id: str | None = None):
    """Prepare a NIfTI case exactly as ``bigmem convert`` prepared the cases a model trained on.

    Canonical (RAS) orientation, the ``--spacing`` resampling and ``--shape`` crop/pad convert used,
    with convert's own functions; and the case's intensity statistics, taken where convert takes
    them (after resampling, before the crop or pad). Intensities are left as they are: the model's
    ``Preprocessing.normalize`` with these statistics normalises them as training did.

    Args:
        image_paths: one 3D or 4D (channels last) NIfTI file, or one 3D file per channel in channel order.
        card: the model's ``ModelCard`` (a run directory's ``preprocessing.json``), or a store (or its
            path) whose cases the model was trained on.
        case_id: the case's id, for messages and the geometry (default: the first file's name without
            .nii[.gz] and _0000; a KiTS case folder's files are all 'imaging').

    Returns:
        ``(image, geometry, stats)``: ``(D, H, W, C)`` float32 on the grid convert would have written,
        the ``CaseGeometry`` that maps predictions on it back to the file's grid, and the case's
        ``preprocess.case_statistics``.

    Raises:
        DataError: a file is unreadable or holds NaN/Inf, or the channel count differs from the model's.

    Example:
        >>> image, geometry, stats = prepare_nifti("imagesTs/BRATS_485.nii.gz", ModelCard.of_run("runs/brats"))
    """
    from bigmem.data.convert import centre_fit, resample_image
    from bigmem.data.nifti import case_id_of, load_channels
    from bigmem.data.preprocess import case_statistics
    from bigmem.infer.modelcard import ModelCard

    paths = [Path(image_paths)] if isinstance(image_paths, (str, os.PathLike)) else [Path(p) for p in image_paths]
    if not paths:
        raise DataError("prepare_nifti: no image file given; expected one 3D/4D file or one 3D file per channel.")
    if not isinstance(card, ModelCard):
        card = ModelCard.from_store(card.path if isinstance(card, HDF5VolumeStore) else card)
    case_id = case_id or case_id_of(paths[0])
    loaded = load_channels(paths, case_id)
    if loaded.image.shape[3] != card.num_channels:
        raise DataError(f"Case {case_id!r}: {loaded.image.shape[3]} channel{'s' if loaded.image.shape[3] != 1 else ''}"
                        f" in {', '.join(map(str, paths))}; the model takes {card.num_channels} "
                        f"({', '.join(card.channel_names)}).")
    image, affine, grid_spacing = loaded.image, loaded.affine, loaded.spacing
    if card.spacing is not None:
        image, affine, grid_spacing = resample_image(image, affine, grid_spacing, card.spacing)
    grid_shape = image.shape[:3]
    try:
        stats = case_statistics(image)
    except DataError as exc:
        raise DataError(f"Case {case_id!r}: {exc.template} ({', '.join(map(str, paths))}).") from None
    offsets = [(0, 0)] * 3
    if card.shape is not None:
        image, _, offsets = centre_fit(image, None, card.shape)
    geometry = CaseGeometry(case_id, loaded.source_shape, loaded.source_affine, grid_shape, affine, image.shape[:3],
                            offsets, grid_spacing)
    return np.ascontiguousarray(image, dtype=np.float32), geometry, stats


# ---- whole-volume inference -------------------------------------------------------------


def pad_to_multiple(image: np.ndarray, divisor: int | Sequence[int], value: np.ndarray | float | None = None):
    """Pad each spatial axis, centred, up to the next multiple of ``divisor`` (one, or per axis), at the background
    value.

    Centred and valued as training pads (``data.pipeline.fit_to_shape``: ``(size_needed - size) // 2``
    before, at what the case's darkest voxel normalises to, its background), so the network sees the
    same border in both.

    Args:
        image: ``(D, H, W)`` or ``(D, H, W, C)``.
        divisor: the network's size contract (``2 ** depth``: 16 for four downsamplings), or per axis ``(D, H, W)``
            (``ModelConfig.divisors``).
        value: the padded voxels' value, per channel or one (default None: each channel's
            minimum; predict gives ``Preprocessing.background``).

    Returns:
        ``(padded, slices)``: the padded array (``image`` itself when no axis needs padding) and the three
        slices that crop a ``(D', H', W', ...)`` output back to ``image``'s grid (``crop_padding``).

    Raises:
        DataError: ``divisor`` < 1 or ``image`` is not 3D/4D.

    Example:
        >>> padded, slices = pad_to_multiple(np.zeros((33, 34, 35, 1), np.float32), 16)
        >>> padded.shape, crop_padding(padded, slices).shape  # (48, 48, 48, 1), (33, 34, 35, 1)
    """
    divisors = (divisor,) * 3 if np.isscalar(divisor) else tuple(divisor)
    if len(divisors) != 3 or any(int(d) != d or d < 1 for d in divisors):
        raise DataError(f"pad_to_multiple: divisor {divisor!r} must be a positive integer (the network's 2**depth), "
                        "or three.")
    if image.ndim not in (3, 4):
        raise DataError(f"pad_to_multiple: image has shape {image.shape}; expected (D, H, W) or (D, H, W, C).")
    widths, slices = [], []
    for size, divisor in zip(image.shape[:3], divisors):
        total = -(-size // divisor) * divisor - size
        before = total // 2
        widths.append((before, total - before))
        slices.append(slice(before, before + size))
    if not any(after or before for before, after in widths):
        return image, tuple(slices)
    channels = image if image.ndim == 4 else image[..., np.newaxis]
    fill = channels.min(axis=(0, 1, 2)) if value is None else np.broadcast_to(np.asarray(value, image.dtype),
                                                                            channels.shape[3:])
    padded = np.empty(tuple(s + b + a for s, (b, a) in zip(image.shape[:3], widths)) + channels.shape[3:], image.dtype)
    padded[...] = fill
    padded[tuple(slices)] = channels
    return (padded if image.ndim == 4 else padded[..., 0]), tuple(slices)


def crop_padding(array: np.ndarray, slices: tuple[slice, slice, slice]) -> np.ndarray:
    """Undo ``pad_to_multiple`` on an output with the padded spatial shape (a view; channels kept).

    Example:
        >>> probs = crop_padding(model_output[0], slices)  # (D, H, W, num_classes)
    """
    return array[tuple(slices)]
