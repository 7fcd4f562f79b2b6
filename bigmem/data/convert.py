"""``bigmem convert``'s API: NIfTI cases -> a bigmem HDF5 store and its manifest.

Each case is read with nibabel, reoriented to the closest canonical orientation (RAS), checked,
optionally centre-cropped/padded to a fixed shape, and written with what a later prediction
needs to map back to the source grid (``source_affine``, ``source_shape``, ``crop_pad``).
Each case's intensity statistics (``preprocess.case_statistics``) and a sample of its foreground
voxels are stored with it, its image in the smallest dtype that keeps it (``preprocess.storage_dtype``:
int16 CT stays int16), and the dataset's normalisation (``preprocess.choose_schemes``) at the root.
The store is written under a temporary name and renamed; the manifest
(``STORE.manifest.json``) is written the same way, after the store. A conversion whose
(uncompressed) store cannot fit in the free space is refused before it starts; a disk that fills
during it raises ``DiskFullError`` and leaves nothing behind.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from bigmem.data.nifti import LoadedCase, SourceCase, SourceDataset, check_header_size, load_case, sha256
from bigmem.data.preprocess import (PREPROCESSING_ATTR, SCHEMES, STATS_ATTR, case_statistics, choose_schemes,
                                    foreground_sample, storage_dtype)
from bigmem.data.store import DEFAULT_CHUNK_EDGE, REGIONS_ATTR, HDF5VolumeStore, StoreWriter, WriteThrottle
from bigmem.errors import DataError, InsufficientMemoryError, UsageError
from bigmem.atomic import atomic_output, require_free_space
from bigmem.units import format_bytes

# Root attribute: JSON {"spacing": [x, y, z] | null, "shape": [d, h, w] | null}, convert's --spacing and --shape.
CONVERT_OPTIONS_ATTR = "convert_options"


def manifest_path(store: Path) -> Path:
    return store.with_name(store.name.removesuffix(".h5") + ".manifest.json")


def centre_fit(image: np.ndarray, label: np.ndarray | None, shape: Sequence[int]):
    """Centre-crop or zero-pad each spatial axis to ``shape``; returns the per-axis (crop, pad) offsets.

    ``label`` may be None (an image without a label, as ``bigmem predict`` fits one); None is returned for it.
    """
    offsets = []
    for axis, target in enumerate(shape):
        size = image.shape[axis]
        crop = max(0, (size - target) // 2)
        pad = max(0, (target - size) // 2)
        if size > target:
            image = np.take(image, np.arange(crop, crop + target), axis=axis)
            if label is not None:
                label = np.take(label, np.arange(crop, crop + target), axis=axis)
        elif size < target:
            widths = [(0, 0)] * image.ndim
            widths[axis] = (pad, target - size - pad)
            image = np.pad(image, widths)
            if label is not None:
                label = np.pad(label, widths[:3])
        offsets.append((crop, pad))
    return image, label, offsets


def resample_zoom(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> np.ndarray:
    """Per-axis zoom from a grid of ``shape`` at ``spacing`` to the grid nearest ``target`` spacing (mm).

    The new shape is round(shape x spacing / target), at least 1; the zoom is new shape / shape, so
    the new spacing is spacing / zoom (close to, not exactly, ``target``).
    """
    shape = np.asarray(shape[:3])
    new_shape = np.maximum(1, np.round(shape * np.asarray(spacing, np.float64) / np.asarray(target, np.float64)))
    return new_shape.astype(int) / shape


def zoomed_affine(affine: np.ndarray, zoom: np.ndarray) -> np.ndarray:
    """The affine of a grid zoomed by ``zoom`` with its field of view's outer edges kept (``grid_mode``)."""
    out = np.asarray(affine, np.float64).copy()
    out[:3, :3] = affine[:3, :3] / zoom  # column j scaled by 1/zoom_j
    out[:3, 3] = affine[:3, :3] @ (0.5 / zoom - 0.5) + affine[:3, 3]  # voxel 0's new centre
    return out


def resample_image(image: np.ndarray, affine: np.ndarray, spacing: Sequence[float], target: Sequence[float]):
    """Resample a canonical ``(D, H, W, C)`` image to ``target`` spacing (trilinear): (image, affine, spacing)."""
    from scipy import ndimage

    zoom = resample_zoom(image.shape, spacing, target)
    image = np.stack([ndimage.zoom(image[..., c], zoom, order=1, grid_mode=True, mode="grid-constant")
                      for c in range(image.shape[3])], axis=-1).astype(np.float32)
    new_spacing = tuple(float(s) for s in np.asarray(spacing, np.float64) / zoom)
    return image, zoomed_affine(affine, zoom), new_spacing


def resample(loaded: LoadedCase, target: Sequence[float]) -> LoadedCase:
    """Resample a canonical case to voxel ``target`` spacing (mm): image trilinear, label nearest.

    The new shape is round(shape x spacing / target); the field of view's outer edges stay in place
    (``grid_mode``), and the affine is rebuilt so every voxel keeps its world position.
    """
    from scipy import ndimage

    image, affine, spacing = resample_image(loaded.image, loaded.affine, loaded.spacing, target)
    zoom = resample_zoom(loaded.label.shape, loaded.spacing, target)
    label = ndimage.zoom(loaded.label, zoom, order=0, grid_mode=True, mode="grid-constant").astype(np.uint8)
    return LoadedCase(loaded.case_id, image, label, affine, loaded.source_affine, loaded.source_shape, spacing)


def _absolute(path: Path) -> str:
    """A source path as the store records it: absolute, so evaluate finds the file from any folder."""
    return str(Path(path).absolute())


def _per_file(case: SourceCase, value: Callable = _absolute):
    """``value`` of the case's image file, or a list of it per channel file (nnU-Net v2's CASE_0000, ...)."""
    values = [value(path) for path in case.image_files]
    return values[0] if len(values) == 1 else values


@dataclass
class ConvertReport:
    store: Path
    manifest: Path
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one message per skipped case
    preprocessing: list[str] = field(default_factory=list)  # the normalisation chosen, one line per channel
    notes: list[str] = field(default_factory=list)  # what the user should know about the result


class _Conversion:
    """The state of one conversion: what was written, skipped, and learnt from the cases."""

    def __init__(self, report: ConvertReport, *, skip_bad: bool, warn, existing: set[str], num_channels: int | None,
                 label_values: int | None, shape, spacing=None):
        self.spacing = spacing
        self.report = report
        self.skip_bad = skip_bad
        self.warn = warn
        self.existing = existing
        self.num_channels = num_channels
        self.label_values = label_values
        self.shape = shape
        self.entries: dict[str, dict] = {}
        self.seen_values: set[int] = set()
        self.stats: list[dict] = []  # every case's case_statistics, for the dataset's normalisation
        self.samples: list[np.ndarray] = []  # every case's foreground sample, for the CT statistics
        self.spacing_off: tuple[float, str, tuple] = (0.0, "", ())  # the furthest from --spacing
        # who expects num_channels and label_values, for a case's message (set by convert for --append)
        self.channels_from, self.labels_from = "dataset.json names", "dataset.json's labels"

    def problem(self, message: str) -> None:
        if not self.skip_bad:
            raise DataError(message)
        self.report.skipped.append(message)
        if self.warn:
            self.warn(f"skipped: {message}")

    def note_spacing(self, case_id: str, spacing: Sequence[float]) -> None:
        """Keep the case whose grid is furthest from --spacing: a grid of whole voxels is rarely exact."""
        off = max(abs(got - want) / want for got, want in zip(spacing, self.spacing))
        if off > self.spacing_off[0]:
            self.spacing_off = (off, case_id, tuple(spacing))

    def spacing_note(self) -> str | None:
        """One line when some case's spacing is not exactly --spacing (round(shape x spacing / target) voxels)."""
        off, case_id, spacing = self.spacing_off
        if off <= 1e-6:
            return None
        asked, got = ",".join(f"{s:g}" for s in self.spacing), "x".join(f"{s:.4g}" for s in spacing)
        return (f"--spacing {asked}: each case is resampled to a whole number of voxels over its field of view, "
                f"so its spacing is the nearest that gives one (furthest: {case_id!r} at {got} mm, "
                f"{100 * off:.2f}% off); the manifest lists every case's.")

    def add(self, case, writer: StoreWriter) -> None:
        """Load, check, fit and write one case (or report it as a problem)."""
        if case.case_id in self.existing:
            self.problem(f"Case {case.case_id!r}: already in {self.report.store} (--append adds new cases only).")
            return
        try:
            loaded = load_case(case, num_channels=self.num_channels, label_values=self.label_values,
                               channels_from=self.channels_from, labels_from=self.labels_from)
        except DataError as exc:
            self.problem(str(exc))
            return
        if self.num_channels is None:
            self.num_channels = loaded.image.shape[3]  # the first case fixes it for --images/--labels
            self.channels_from = f"the first case ({case.case_id!r}) has"
        if self.spacing is not None:
            loaded = resample(loaded, self.spacing)
            self.note_spacing(case.case_id, loaded.spacing)
        image, label, offsets = loaded.image, loaded.label, [(0, 0)] * 3
        if self.shape is not None:
            image, label, offsets = centre_fit(image, label, self.shape)
        try:  # the statistics of the case as converted, before any crop or pad (as predict computes them)
            stats = case_statistics(loaded.image)
        except DataError as exc:
            self.problem(f"Case {case.case_id!r}: {exc} ({case.image_text}).")
            return
        foreground = foreground_sample(loaded.image, loaded.label)
        self.stats.append(stats)
        self.samples.append(foreground)
        dtype = storage_dtype(image, stats)
        image = image.astype(dtype, copy=False)
        writer.add_case(case.case_id, image, label, spacing=loaded.spacing, affine=loaded.affine,
                        source_affine=loaded.source_affine, source_image=_per_file(case),
                        source_label=_absolute(case.label),
                        attrs={"source_shape": list(loaded.source_shape), "canonical_shape": list(loaded.label.shape),
                               "crop_pad": np.asarray(offsets, np.int64), STATS_ATTR: json.dumps(stats)},
                        foreground=foreground)
        values = sorted(int(v) for v in np.unique(label))
        self.seen_values.update(values)
        self.entries[case.case_id] = {
            "shape": list(image.shape), "source_shape": list(loaded.source_shape), "spacing": list(loaded.spacing),
            "image_dtype": dtype.name, "label_dtype": "uint8", "label_values": values, "intensity_stats": stats,
            "source_image": _per_file(case), "source_label": _absolute(case.label),
            "source_sha256": {"image": _per_file(case, sha256), "label": sha256(case.label)},
        }
        self.report.converted.append(case.case_id)


# The arrays one case holds at once while converted, per voxel: the image as float32 twice (the
# resampled channels and their stack; or the loaded and the centre-fitted copy, or the loaded and
# storage_dtype's rounded copy), case_statistics' float64 copy of the nonzero voxels and the
# float32 gather it is made from, per channel; the label uint8 twice.
CASE_BYTES_PER_CHANNEL_VOXEL = 4 + 4 + 8 + 4
CASE_BYTES_PER_LABEL_VOXEL = 2


def check_arguments(*, shape: Sequence[int] | None = None, spacing: Sequence[float] | None = None,
                    chunk_edge: int | None = None) -> None:
    """Raise ``UsageError`` (naming ``convert``'s parameter) for a shape, spacing or chunk edge it cannot use.

    Example:
        >>> check_arguments(shape=(64, 64, 64), spacing=(1.0, 1.0, 1.5), chunk_edge=64)  # no error
    """
    if shape is not None and (len(shape) != 3 or any(isinstance(s, bool) or int(s) != s or s < 1 for s in shape)):
        raise UsageError(f"Invalid shape {tuple(shape)}: expected three positive integers (D, H, W).")
    if spacing is not None and (len(spacing) != 3 or not all(0 < float(s) < math.inf for s in spacing)):
        raise UsageError(f"Invalid spacing {tuple(spacing)}: expected three positive, finite numbers (mm).")
    if chunk_edge is not None and chunk_edge < 1:
        raise UsageError(f"Invalid chunk_edge {chunk_edge}: expected a positive edge in voxels, or None.")


def check_append(dataset: SourceDataset, out: Path, num_channels: int, num_classes: int,
                 regions: dict[str, list[int]] | None = None) -> None:
    """Refuse appending a dataset whose dataset.json names other channels, more classes or other regions than
    the store has (``regions``: the store's, ``HDF5VolumeStore.regions``); a refusal of its channels names its
    first case (every case has the channels its dataset.json names) and that case's image files."""
    if not dataset.declared_labels:
        return  # --images/--labels: each case is checked against the store as it loads
    channels = len(dataset.channel_names)
    if channels != num_channels:
        first = dataset.cases[0] if dataset.cases else None
        named = f": case {first.case_id!r} ({first.image_text}) is the first that does not fit" if first else ""
        raise DataError(f"Cannot {{convert.append}} {dataset.origin}'s {channels} "
                        f"channel{'s' if channels != 1 else ''} ({', '.join(dataset.channel_names)}) to {str(out)!r}, "
                        f"whose cases have {num_channels}{named}.")
    classes = dataset.min_classes or len(dataset.label_names)
    if classes > num_classes:
        raise DataError(f"Cannot {{convert.append}} {dataset.origin}'s {classes} classes to {str(out)!r}, "
                        f"which has {num_classes}.")
    if regions is not None and dataset.regions != regions:
        raise DataError(f"Cannot {{convert.append}} {dataset.origin}'s regions ({_regions_text(dataset.regions)}) "
                        f"to {str(out)!r}, whose regions are {_regions_text(regions)}.")


def _regions_text(regions: dict[str, list[int]]) -> str:
    return "; ".join(f"{name}: {values}" for name, values in regions.items()) or "none"


def check_cases_fit_memory(dataset: SourceDataset, *, shape: Sequence[int] | None, spacing: Sequence[float] | None,
                           num_channels: int, skip_bad: bool = False) -> None:
    """Refuse, before any case is read, a conversion whose largest case cannot fit in available memory.

    Reads every case's headers (not its voxels): a file whose header claims more voxels than the
    machine could hold is refused here as it would be when loaded (``nifti.check_header_size``;
    left to the case's own checks with ``skip_bad``, as are unreadable headers). With
    ``spacing``, a case's resampled size is shape x voxel size / spacing; ``shape`` fixes the
    written size. Per voxel a case holds ``CASE_BYTES_PER_CHANNEL_VOXEL`` bytes per channel and
    ``CASE_BYTES_PER_LABEL_VOXEL`` for its label.

    Raises:
        DataError: a header claims more than the available memory (without ``skip_bad``).
        InsufficientMemoryError: (exit 3) the largest case at ``spacing``/``shape`` needs more
            than MemAvailable.
    """
    import nibabel as nib
    import psutil

    per_voxel = CASE_BYTES_PER_CHANNEL_VOXEL * num_channels + CASE_BYTES_PER_LABEL_VOXEL
    fitted = int(np.prod(shape, dtype=object)) if shape is not None else 0
    largest, what = fitted * per_voxel, (f"a case cropped/padded to {'x'.join(map(str, shape))}" if shape else "")
    target = float(np.prod(np.asarray(spacing, np.float64))) if spacing is not None else None
    for case in dataset.cases:
        try:
            images = [(nib.load(str(path)), what_file, path) for what_file, path in
                      (*(("image", p) for p in case.image_files), ("label", case.label))]
        except Exception:  # noqa: BLE001  (reported, with the case, when the case is loaded)
            continue
        try:
            for img, what_file, path in images:
                check_header_size(img, case.case_id, what_file, path)
        except DataError:
            if skip_bad:
                continue
            raise
        if target is None:
            continue
        header = images[0][0].header
        voxels = float(np.prod(header.get_data_shape()[:3], dtype=np.float64))
        extent = float(np.prod(np.asarray(header.get_zooms()[:3], np.float64)))
        needed = int(voxels * extent / target) * per_voxel + fitted * per_voxel
        if needed > largest:
            spacing_text = ",".join(f"{s:g}" for s in spacing)
            largest, what = needed, f"case {case.case_id!r} at {{convert.spacing}} {spacing_text}"
    available = int(psutil.virtual_memory().available)
    if largest > available:
        fix = "coarser {convert.spacing}" if "spacing" in what else "smaller {convert.volume} or {convert.shape}"
        raise InsufficientMemoryError(
            f"Converting {what} needs about {format_bytes(largest)} of memory for one case, more than the "
            f"{format_bytes(available)} available (MemAvailable); choose a "
            f"{fix}.", largest, available)


# A case's bytes beyond its voxels: HDF5's object headers, attributes (affines, intensity
# statistics) and chunk index, and its manifest entry. Measured on tests/data/test_convert.py's
# three ~35^3 cases: 5.0 KiB (contiguous) to 11.5 KiB (64^3 chunks) per case in the store, plus
# 1.0 KiB in the manifest; rounded up. (The chunk index grows by tens of bytes per chunk.)
STORE_BYTES_PER_CASE = 16 * 1024


def estimate_store_bytes(cases: Iterable[SourceCase], *, shape: Sequence[int] | None = None,
                         spacing: Sequence[float] | None = None) -> int:
    """About the bytes ``cases`` take in an uncompressed store: images float32, labels uint8.

    Read from the NIfTI headers only (no voxels): each case's voxels after resampling to
    ``spacing`` and fitting to ``shape``, times 4 bytes per channel + 1 for the label, plus
    ``STORE_BYTES_PER_CASE`` of metadata. A case whose header cannot be read, or claims more
    voxels than memory could hold (``nifti.check_header_size``), counts 0 (its own checks report
    it when it is loaded, or skip it with ``skip_bad``).

    Args:
        cases: the cases (a ``SourceDataset``'s ``cases``).
        shape: ``(D, H, W)`` every case is fitted to (default None: its own).
        spacing: the spacing ``(x, y, z)`` in mm the cases are resampled to (default None: their own).

    Returns:
        The estimate in bytes.

    Example:
        >>> estimate_store_bytes(read_dataset("Task04_Hippocampus").cases, shape=(32, 48, 32))  # cases x 49152 x 5 B
    """
    import nibabel as nib

    total = 0
    for case in cases:
        try:
            image = nib.load(str(case.image_files[0]))  # the header only (of the first channel file)
            check_header_size(image, case.case_id, "image", case.image_files[0])  # a corrupt header: the case's problem
            header = image.header
            file_shape = header.get_data_shape()
            channels = (int(np.prod(file_shape[3:])) if len(file_shape) > 3 else 1) * len(case.image_files)
            if shape is not None:
                voxels = int(np.prod(shape))
            elif spacing is not None:  # resample_zoom works on the canonical (RAS) axes
                to_canonical = nib.io_orientation(header.get_best_affine())[:, 0].astype(int)
                canonical_shape, canonical_spacing = np.zeros(3), np.zeros(3)
                canonical_shape[to_canonical] = file_shape[:3]
                canonical_spacing[to_canonical] = header.get_zooms()[:3]
                zoom = resample_zoom(canonical_shape, canonical_spacing, spacing)
                voxels = int(np.prod(np.round(zoom * canonical_shape)))
            else:
                voxels = int(np.prod(file_shape[:3]))
        except Exception:  # noqa: BLE001  (reported, with the case, when the case is loaded)
            continue
        total += voxels * (4 * channels + 1) + STORE_BYTES_PER_CASE
    return total


def convert(dataset: SourceDataset, out: str | Path, *, force: bool = False, append: bool = False,
            skip_bad: bool = False, compression: str | None = None, chunk_edge: int | None = DEFAULT_CHUNK_EDGE,
            shape: Sequence[int] | None = None, progress: Callable[[str], None] | None = None,
            warn: Callable[[str], None] | None = None, max_write_rate: float | None = None,
            block_bytes: int | None = None, spacing: Sequence[float] | None = None, normalization: str = "auto",
            ) -> ConvertReport:
    """Write ``dataset``'s cases to the store ``out`` (atomically) and its manifest beside it.

    Each case is loaded in canonical (RAS) orientation and checked, resampled to ``spacing`` and
    centre-cropped/padded to ``shape`` if given, and written with its source geometry and per-channel
    intensity statistics. The store and its manifest (``OUT.manifest.json``) are written under
    temporary names and renamed, so neither is ever left half-written.

    Args:
        dataset: the cases (``layouts.read_dataset``, ``layouts.read_globs``); its ``regions`` are written
            as the store's ``regions`` attribute and in the manifest.
        out: the store to write.
        force, append: overwrite an existing ``out``, or add ``dataset``'s new cases to it (default neither).
        skip_bad: skip a case that fails a check, with a message in the report, instead of raising.
        compression, chunk_edge: an h5py filter such as ``"gzip"`` (default None), and the chunk edge in voxels
            (default ``DEFAULT_CHUNK_EDGE``, 64; None: contiguous, the fastest whole reads, unless compressed).
        progress, warn: called with each case id once it is handled, and with each skipped case's message.
        max_write_rate, block_bytes: the most bytes per second written, and per write and flush (default
            None: no limit, whole datasets).
        spacing, shape: the voxel spacing ``(x, y, z)`` in mm to resample every case to, and the ``(D, H, W)`` in
            voxels to centre-crop/pad it to (default None: keep each).
        normalization: ``auto`` (default: per channel, ``ct`` for a channel named CT, else a z-score, within
            the nonzero mask where the cases are mostly zero; ``preprocess.choose_schemes``; with ``append``, the
            store's schemes, the CT figures taken again from every case), or one of ``preprocess.SCHEMES``.

    Returns:
        A ``ConvertReport``: the store and manifest paths, the converted case ids, a message per skipped case.

    Raises:
        UsageError: a ``shape``, ``spacing`` or ``chunk_edge`` it cannot use (``check_arguments``).
        DataError: ``out`` is a directory, or exists without ``force``/``append``; ``append`` to a missing
            store, or of a dataset with other channels or more classes; a case fails a check (without
            ``skip_bad``); or no case could be converted.
        InsufficientMemoryError: a case at ``spacing``/``shape`` cannot fit in memory (``check_cases_fit_memory``).
        DiskFullError: the store (uncompressed: ``estimate_store_bytes``) cannot fit in the free space, or the
            disk filled or failed while writing; nothing is left behind.

    Example:
        >>> report = convert(read_dataset("Task01_BrainTumour"), "brats.h5", shape=(160, 192, 160))
        >>> report.converted, report.manifest  # the case ids written, PosixPath('brats.manifest.json')
    """
    out = _checked_target(Path(out), force=force, append=append, normalization=normalization, shape=shape,
                          spacing=spacing, chunk_edge=chunk_edge)
    report = ConvertReport(out, manifest_path(out))
    before = _before(dataset, out, report, append=append, normalization=normalization)
    state = _conversion(dataset, out, report, before, skip_bad=skip_bad, warn=warn, append=append, shape=shape,
                        spacing=spacing)
    expected = _expected_bytes(dataset, out, before, append=append, compression=compression, shape=shape,
                               spacing=spacing)
    with _writer(out, before, compression=compression, chunk_edge=chunk_edge, append=append,
                 throttle=WriteThrottle(max_write_rate, block_bytes), expected_bytes=expected) as writer:
        _write_cases(writer, dataset, report, before, state, append=append, shape=shape, spacing=spacing,
                     progress=progress)
    return report


def _writer(out: Path, before: "_Before", *, compression, chunk_edge, append: bool, throttle,
            expected_bytes: int) -> StoreWriter:
    """The store's writer, with the channels and classes already in it (with append); told the bytes it will
    write where they are known (uncompressed)."""
    return StoreWriter(out, num_classes=max(before.label_values or 2, 2),
                       channel_names=before.channel_names or ["image"], label_names=before.label_names or None,
                       compression=compression, chunk_edge=chunk_edge, append=append, throttle=throttle,
                       expected_bytes=expected_bytes if compression is None else None)


def _expected_bytes(dataset: SourceDataset, out: Path, before: "_Before", *, append: bool, compression, shape,
                    spacing) -> int:
    """The bytes the new store will take, refused unless they fit the free space.

    The new store is written beside the old one (with append, beside a copy of it): all of it must fit.
    Compressed, the estimate is only an upper bound: nothing is refused before trying then.
    """
    expected = estimate_store_bytes([c for c in dataset.cases if c.case_id not in before.case_ids], shape=shape,
                                    spacing=spacing) + (out.stat().st_size if append else 0)
    if compression is None:
        require_free_space(out, expected)
    return expected


def _before(dataset: SourceDataset, out: Path, report: ConvertReport, *, append: bool,
            normalization: str) -> "_Before":
    """What the store holds before this conversion (nothing, unless ``append``), its new cases checked against it."""
    before = _Before.of(out, dataset, normalization) if append else _Before.none(dataset, normalization)
    if append:
        check_append(dataset, out, before.num_channels, before.label_values, before.regions)
        if report.manifest.exists():
            before.manifest_entries = json.loads(report.manifest.read_text()).get("cases", {})
    return before


def _conversion(dataset: SourceDataset, out: Path, report: ConvertReport, before: "_Before", *, skip_bad: bool,
                warn, append: bool, shape, spacing) -> "_Conversion":
    """The conversion's state, told what a case's channels and labels are checked against and the dataset's
    problems, once every case at ``shape``/``spacing`` is known to fit in memory."""
    check_cases_fit_memory(dataset, shape=shape, spacing=spacing, num_channels=before.num_channels or 1,
                           skip_bad=skip_bad)
    state = _Conversion(report, skip_bad=skip_bad, warn=warn, existing=before.case_ids,
                        num_channels=before.num_channels, label_values=before.label_values, shape=shape,
                        spacing=spacing)
    state.channels_from, state.labels_from = (
        (f"--append: the store {out.name!r} has", f"--append: the store {out.name!r}'s classes") if append
        else (dataset.channels_from, dataset.labels_from))
    for message in dataset.problems:
        state.problem(message)
    return state


def _write_cases(writer, dataset: SourceDataset, report: ConvertReport, before: "_Before", state: "_Conversion", *,
                 append: bool, shape, spacing, progress) -> None:
    """Each case, then the dataset's attributes, the normalisation chosen per channel, and the store and its
    manifest committed together."""
    for case in dataset.cases:
        state.add(case, writer)
        if progress:
            progress(case.case_id)
    if not report.converted:
        raise DataError(f"No case could be converted from {dataset.origin}"
                        + (f" ({len(report.skipped)} skipped)." if report.skipped else "."))
    if not append:
        _set_dataset_attrs(writer, dataset, state, before.regions, shape=shape, spacing=spacing)
    names = [str(n) for n in writer.root_attr("channel_names")]
    preprocessing = choose_schemes(names, before.stats + state.stats, before.samples + state.samples,
                                   before.normalization)
    writer.set_root_attr(PREPROCESSING_ATTR, preprocessing.to_json())
    report.preprocessing = preprocessing.describe(names)
    report.notes = [note for note in (state.spacing_note(),) if note]
    _commit_with_manifest(writer, report, dataset, before, state, preprocessing)


def _checked_target(out: Path, *, force: bool, append: bool, normalization: str, shape, spacing, chunk_edge) -> Path:
    """``out``, once the arguments are ones ``convert`` can use and ``out`` one it may write, before anything is
    read."""
    check_arguments(shape=shape, spacing=spacing, chunk_edge=chunk_edge)
    if normalization != "auto" and normalization not in SCHEMES:
        raise UsageError(f"Invalid normalization {normalization!r}: expected auto, {', '.join(SCHEMES)}.")
    if out.is_dir():
        raise DataError(f"Cannot write the store {str(out)!r}: it is a directory; give a file name such as "
                        f"{str(out / 'store.h5')!r}.")
    if out.exists() and not (force or append):
        raise DataError(f"{str(out)!r} exists: pass {{convert.force}} to overwrite it or {{convert.append}} to "
                        "add cases.")
    if append and not out.exists():
        raise DataError(f"Cannot {{convert.append}} to {str(out)!r}: no such store.")
    return out


@dataclass
class _Before:
    """What the store holds before this conversion: nothing for a new store; with --append, what the new cases join.

    The dataset's normalisation is chosen again from every case, the old ones' figures included;
    appended cases keep the store's schemes (``normalization``) unless one was asked for.
    """

    case_ids: set[str]
    num_channels: int | None
    label_values: int | None
    channel_names: list[str]
    label_names: list[str]
    regions: dict
    normalization: str | list[str]
    stats: list[dict] = field(default_factory=list)
    samples: list[np.ndarray] = field(default_factory=list)
    manifest_entries: dict = field(default_factory=dict)

    @classmethod
    def none(cls, dataset: SourceDataset, normalization: str) -> "_Before":
        declared = dataset.declared_labels
        return cls(set(), len(dataset.channel_names) if declared else None,
                   len(dataset.label_names) if declared else None, dataset.channel_names, dataset.label_names,
                   dataset.regions, normalization)

    @classmethod
    def of(cls, out: Path, dataset: SourceDataset, normalization: str) -> "_Before":
        with HDF5VolumeStore(out) as store:
            if normalization == "auto" and store.preprocessing_recorded:
                normalization = [c.scheme for c in store.preprocessing.channels]
            before = cls(set(store.case_ids), store.num_channels, store.num_classes, store.channel_names,
                         store.label_names, store.regions, normalization,
                         [store.case_stats(c) or {} for c in store.case_ids],
                         [s for s in (store.foreground_sample(c) for c in store.case_ids) if s is not None])
        return before


def _set_dataset_attrs(writer, dataset: SourceDataset, state, regions: dict, *, shape, spacing) -> None:
    """A new store's classes, names, regions and convert options, once its cases are written."""
    if not dataset.declared_labels:  # --images/--labels: the data defines the classes
        num_classes = max(max(state.seen_values) + 1, 2)
        writer.set_root_attr("num_classes", num_classes)
        writer.set_root_attr("label_names", [f"class{i}" for i in range(num_classes)])
        writer.set_root_attr("channel_names", [f"channel{i}" for i in range(state.num_channels or 1)])
    if dataset.declared_labels and dataset.min_classes:  # KiTS: cyst where a label holds it
        num_classes = max(dataset.min_classes, max(state.seen_values) + 1)
        writer.set_root_attr("num_classes", num_classes)
        writer.set_root_attr("label_names", [str(n) for n in dataset.label_names[:num_classes]])
    if regions:  # nnU-Net v2 regions: trained as classes, kept for scoring
        writer.set_root_attr(REGIONS_ATTR, json.dumps(regions))
    # what a new case needs to be prepared as these were (bigmem.infer.geometry.prepare_nifti)
    writer.set_root_attr(CONVERT_OPTIONS_ATTR, json.dumps(
        {"spacing": None if spacing is None else [float(s) for s in spacing],
         "shape": None if shape is None else [int(s) for s in shape]}))


def _commit_with_manifest(writer, report: ConvertReport, dataset: SourceDataset, before: _Before, state,
                          preprocessing) -> None:
    """Write the manifest, then rename the store into place: both appear, or neither changes."""
    manifest = {"store": report.store.name, "source": dataset.origin,
                "num_classes": int(writer.root_attr("num_classes")),
                "channel_names": [str(n) for n in writer.root_attr("channel_names")],
                "label_names": [str(n) for n in writer.root_attr("label_names")], "regions": before.regions,
                "preprocessing": json.loads(preprocessing.to_json()),
                "cases": {**before.manifest_entries, **state.entries}}
    text = json.dumps(manifest, indent=2, default=str) + "\n"
    # The manifest is written first and renamed last: a failure of either removes both temporaries,
    # and leaves any existing store and manifest as they were.
    with atomic_output(report.manifest, needed_bytes=writer.tmp_path.stat().st_size + len(text)) as tmp:
        tmp.write_text(text)
        writer.commit()
