"""``bigmem evaluate``'s API: predicted label maps against references, per case and per class.

Predictions are a folder of NIfTI label maps (``<case>.nii.gz`` or ``.nii``); references are a
dataset folder whose label maps ``bigmem.data.layouts.list_labels`` lists under the case ids
``bigmem predict`` writes (an MSD or nnU-Net v2 folder's labelsTr/ and labelsTs/, KiTS case
folders' segmentation.nii.gz, or a folder of label maps, each case the file name:
:func:`label_case_id`), or a bigmem HDF5 store, whose cases are compared in the source geometry
(:func:`store_reference`: the source label where convert resampled or cropped it). Both are
compared voxel for voxel as stored (no reorientation), with the reference's spacing. The summary
follows nnU-Net v2's ``summary.json`` (``metric_per_case``, ``mean``, ``foreground_mean``); undefined values
(:data:`bigmem.infer.metrics.EMPTY_RULE`) are written as null. Where regions are defined (BraTS's
whole tumour, tumour core, enhancing tumour: label values per region), each is scored beside the
classes (:func:`bigmem.infer.metrics.region_metrics`).

Class names and regions come from the reference store, else the run (``run``: its
``preprocessing.json``, or its training store), else the reference dataset's dataset.json (MSD's or
nnU-Net v2's: the folder's own, or the one beside a folder of label maps) or KiTS's classes; a
class without a name is ``class<N>``.

The summary: ``{"pred", "ref", "empty_rule", "classes", "label_names", "regions", "num_cases",
"metric_per_case": [{"case_id", "prediction_file", "reference_file", "spacing_mm",
"metrics": {class: {"Dice", "IoU", "TP", "FP", "FN", "n_ref", "n_pred", "ref_volume_ml",
"pred_volume_ml", "HD95_mm"}}}], "mean": {class: {metric: ...}}, "foreground_mean":
{metric: ...}, "num_undefined": {class: {"Dice", "IoU", "HD95_mm"}}, "missing":
{"no_reference", "no_prediction"}, "warnings": [...]}``, with class keys as strings and
undefined values as None. ``label_names`` names every class evaluated (``class<N>`` where nothing
names it); ``regions`` maps region names to label values (``{}`` where none are defined). With
regions, each case also has ``region_metrics`` ``{region: {metric: ...}}``, and the summary
``region_mean``, ``region_foreground_mean`` (the mean over regions) and ``region_num_undefined``, as
for classes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bigmem.data.layouts import label_case_id as label_case_id  # the case id of a label map file, re-exported
from bigmem.data.layouts import label_maps, list_labels
from bigmem.errors import DataError, UsageError
from bigmem.infer.metrics import EMPTY_RULE, absent_class_metrics, aggregate, case_metrics, region_metrics
from bigmem.units import format_count

MAX_LABEL = 255  # label maps are held as uint8, as in the store (docs/store.md)
_SLAB_PLANES = 16  # float label files are checked 16 planes at a time: temporaries of a slab, not a volume


REF_EXPECTED = ("a dataset folder (MSD or nnU-Net v2: labelsTr/, labelsTs/; KiTS case folders: "
                "case_00000/segmentation.nii.gz), a folder of NIfTI label maps (<case>.nii.gz) or a bigmem store (.h5)")


def _prediction_files(folder: Path) -> dict[str, Path]:
    """case id -> file for the predicted label maps (``.nii``/``.nii.gz``) directly in PRED ``folder``."""
    if not folder.is_dir():
        raise DataError(f"PRED {str(folder)!r} is not a folder: expected a folder of NIfTI label maps (<case>.nii.gz).")
    files = label_maps(folder, f"PRED {str(folder)!r}")
    if not files:
        raise DataError(f"PRED {str(folder)!r} holds no .nii or .nii.gz file.")
    return files


def _number(value) -> str:
    """An integral value as an integer ('-1000'), else as it is ('0.5')."""
    value = float(value)
    return str(int(value)) if value.is_integer() else f"{value:g}"


def _as_label_map(data: np.ndarray, case_id: str, what: str, path: str) -> np.ndarray:
    """``data`` as uint8 labels, checked: integer values in 0..255 (float files checked slab by slab)."""
    if data.dtype == bool:
        return data.astype(np.uint8, copy=False)
    if not (np.issubdtype(data.dtype, np.integer) or np.issubdtype(data.dtype, np.floating)):
        raise DataError(f"Case {case_id!r}: {what} has data type {data.dtype} ({path}); expected integer labels.")
    if np.issubdtype(data.dtype, np.floating):
        for start in range(0, data.shape[0], _SLAB_PLANES):
            slab = data[start:start + _SLAB_PLANES]
            bad = ~np.isfinite(slab) | (slab != np.round(slab))
            if bad.any():
                raise DataError(f"Case {case_id!r}: {what} has non-integer label values (e.g. {float(slab[bad][0])}) "
                                f"({path}); expected a label map, not probabilities.")
    if data.size:
        low, high = data.min(), data.max()
        if low < 0 or high > MAX_LABEL:
            # A CT in HU (-1024..3071) or an MRI's intensities, given where a label map belongs
            looks = " looks like an image, not a label map:" if low < 0 or high > 2 * MAX_LABEL else ""
            raise DataError(f"Case {case_id!r}: {what} {path}{looks} values {_number(low)}..{_number(high)}; expected "
                            f"labels 0..{MAX_LABEL} (is it the scan, e.g. imaging.nii.gz, instead of its "
                            "segmentation?).")
    return data.astype(np.uint8, copy=False)


def read_label_map(path: Path, case_id: str, what: str) -> tuple[np.ndarray, np.ndarray, tuple[float, ...]]:
    """A NIfTI label map as stored (no reorientation), checked.

    Args:
        path: the ``.nii``/``.nii.gz`` file.
        case_id: the case, for messages.
        what: ``"prediction"`` or ``"reference"``, for messages.

    Returns:
        ``(label, affine, spacing)``: ``(D, H, W)`` uint8, the 4x4 affine, the voxel size in mm
        from the header (``get_zooms()[:3]``).

    Raises:
        DataError: unreadable file, not 3D, non-integer values or labels outside 0..255.

    Example:
        >>> label, affine, spacing = read_label_map(Path("pred/case_001.nii.gz"), "case_001", "prediction")
        >>> label.dtype  # dtype('uint8'), whatever the file stores
    """
    import nibabel as nib

    try:
        image = nib.load(str(path))
        data = np.asanyarray(image.dataobj)
    except Exception as exc:  # nibabel raises many types for a truncated or corrupt file
        raise DataError(f"Case {case_id!r}: cannot read {what} {str(path)!r} ({type(exc).__name__}: {exc}); the "
                        "file may be truncated or not NIfTI.") from None
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"Case {case_id!r}: {what} has shape {data.shape} ({path}); expected a 3D label map.")
    spacing = tuple(float(z) for z in image.header.get_zooms()[:3])
    return _as_label_map(data, case_id, what, str(path)), np.asarray(image.affine, np.float64), spacing


def _dataset_json_labels(path: Path | None, warning: Callable[[str], None]) -> tuple[list[str], dict[str, list[int]]]:
    """(label names, regions) from the reference dataset's dataset.json; ``([], {})`` without a usable one.

    nnU-Net v2's region labels name each class after the region its ``regions_class_order`` paints
    with it, as ``bigmem convert`` names them (``nifti.region_classes``).
    """
    from bigmem.data.nifti import read_dataset_json, region_classes

    if path is None:
        return [], {}
    try:  # only names and regions come from it: the scores do not need it
        meta = read_dataset_json(path)
        names, regions, order = meta["label_names"], meta["regions"], meta["regions_class_order"]
        if regions and order is not None:
            names = region_classes(names[0], regions, order, str(path))
    except DataError as exc:
        warning(f"{exc} Classes are named class1, class2, ... and no regions are scored.")
        return [], {}
    return names, regions


def _run_labels(run_dir: Path, warning: Callable[[str], None]) -> tuple[int, list[str], dict[str, list[int]]]:
    """(number of classes, label names, regions) of a run: its model's classes, named by its model card.

    The names and regions are the run's ``preprocessing.json``'s (``infer.modelcard``), else, for a
    run from before that file, its training store's; with neither, a warning and no names.
    """
    from bigmem.data.store import checked_regions
    from bigmem.infer.modelcard import CARD_NAME, ModelCard
    from bigmem.infer.predict import run_config

    config = run_config(run_dir)
    store = config.data.store
    if not (run_dir / CARD_NAME).is_file() and not (store and Path(store).is_file()):
        warning(f"Run {str(run_dir)!r} has no {CARD_NAME} and its training store {store!r} is gone: nothing names "
                "its classes; they are class1, class2, ...")
        return config.model.num_classes, [], {}
    card = ModelCard.of_run(run_dir, store)
    regions = checked_regions(card.regions, f"Run {str(run_dir)!r}", config.model.num_classes)  # card: unchecked
    return config.model.num_classes, list(card.label_names), regions


class _FolderReferences:
    """References from a dataset folder (``layouts.list_labels``); names and regions from its dataset.json."""

    def __init__(self, folder: Path, warning: Callable[[str], None]):
        if not folder.is_dir():
            raise DataError(f"REF {str(folder)!r} is not a folder: expected {REF_EXPECTED}.")
        listing = list_labels(folder)
        self.files = listing.cases
        self.case_ids = list(self.files)
        self.num_classes: int | None = None
        self.label_names, self.regions = _dataset_json_labels(listing.dataset_json, warning)
        self.label_names = self.label_names or list(listing.label_names)

    def load(self, case_id: str):
        path = self.files[case_id]
        return (*read_label_map(path, case_id, "reference"), str(path))

    def close(self) -> None:
        pass


class _StoreReferences:
    """References from a bigmem store: its cases' labels on their source grids (``store_reference``)."""

    def __init__(self, path: Path, warning: Callable[[str], None]):
        from bigmem.data.store import HDF5VolumeStore

        self.store = HDF5VolumeStore(path)
        self.case_ids = self.store.case_ids
        self.num_classes: int | None = self.store.num_classes
        self.label_names = self.store.label_names
        self.regions = self.store.regions
        self.warning = warning

    def load(self, case_id: str):
        return store_reference(self.store, case_id, warn=self.warning)

    def close(self) -> None:
        self.store.close()


def _open_references(ref: Path, warning: Callable[[str], None]):
    if ref.suffix == ".h5" or ref.is_file():
        return _StoreReferences(ref, warning)
    return _FolderReferences(ref, warning)


def _read_source_label(geometry):
    """``(label, affine, spacing)`` of a case's source label file, checked against its geometry; else why not."""
    from bigmem.data.nifti import AFFINE_TOLERANCE_MM

    if not geometry.source_label:
        return "the store records no source label file"
    path = Path(geometry.source_label)
    if not path.is_file():
        return f"its source label {str(path)!r} is gone"
    try:
        label, affine, spacing = read_label_map(path, geometry.case_id, "reference")
    except DataError as exc:
        return str(exc).rstrip(".")
    if label.shape != geometry.source_shape:
        return f"its source label {str(path)!r} has shape {label.shape}, not the case's {geometry.source_shape}"
    if not np.allclose(affine, geometry.source_affine, atol=AFFINE_TOLERANCE_MM):
        return f"its source label {str(path)!r} has another affine than the case's source"
    return label, affine, spacing


def store_reference(store, case_id: str, *, warn: Callable[[str], None] | None = None):
    """A store case's reference label on its source file's grid, where ``bigmem predict`` writes predictions.

    Where the store keeps the case's voxels as they were (``CaseGeometry.lossless``: not resampled,
    nothing cropped away), it is the store's label mapped back (``source_label_from_store``): exact,
    and no file is read. Where convert resampled it (``--spacing``) or cropped some of it away
    (``--shape``), it is the source label file convert read (the case's ``source_label``), so that
    validation while training scores what ``bigmem predict`` + ``bigmem evaluate`` score against the
    original labels. If that file is gone, or no longer has the case's source shape and affine, it
    is the store's label mapped back (close, not equal: a nearest-neighbour resampling and back),
    and ``warn`` is told.

    Args:
        store: an open ``HDF5VolumeStore`` or its path.
        case_id: the case.
        warn: called with a one-line message when the source label cannot be used.

    Returns:
        ``(label, affine, spacing, where)``: ``source_shape`` uint8 labels, the source's 4x4 affine,
        the voxel size in mm, and what was read (the source label file, or ``STORE:case``).

    Raises:
        DataError: the case is not in the store, or its labels are not labels (0..255).

    Example:
        >>> label, affine, spacing, where = store_reference("brats.h5", "BRATS_001")
        >>> where  # 'MSD/Task01_BrainTumour/labelsTr/BRATS_001.nii.gz' for a store converted with --spacing
    """
    from bigmem.infer.geometry import CaseGeometry, source_label_from_store

    geometry = CaseGeometry.from_store(store, case_id)
    stored = f"{Path(getattr(store, 'path', store))}:{case_id}"
    if not geometry.lossless:
        source = _read_source_label(geometry)
        if not isinstance(source, str):
            return (*source, geometry.source_label)
        if warn is not None:
            changed = "resampled by convert's --spacing" if geometry.resampled else "cropped by convert's --shape"
            warn(f"Case {case_id!r}: the store's label was {changed} and {source}; scored against the store's "
                 "label mapped back to the source grid (close to the source label, not equal).")
    label, affine, spacing = source_label_from_store(store, case_id)
    label = _as_label_map(np.asarray(label), case_id, "reference", stored)
    return label, np.asarray(affine, np.float64), tuple(float(s) for s in spacing), stored


def _count(n: int, noun: str) -> str:
    """'1 case has', '2 cases have'."""
    return f"1 {noun} has" if n == 1 else f"{n} {noun}s have"


def _listed(ids: Sequence[str]) -> str:
    """The first five ids quoted, then how many more: "'a', 'b', 'c', 'd', 'e' and 3 more"."""
    return ", ".join(repr(c) for c in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def _match(pred_ids: Sequence[str], ref_ids: Sequence[str], pred: Path, ref: Path, allow_missing: bool):
    """The case ids in both, in prediction order; the ones missing on each side."""
    ref_set, pred_set = set(ref_ids), set(pred_ids)
    both = [c for c in pred_ids if c in ref_set]
    no_reference = [c for c in pred_ids if c not in ref_set]
    no_prediction = [c for c in ref_ids if c not in pred_set]
    if not both:
        raise DataError(f"No case of PRED {str(pred)!r} is in REF {str(ref)!r} (predictions: {_listed(list(pred_ids))};"
                        f" references: {_listed(list(ref_ids))}); expected the same case ids.")
    if not allow_missing and (no_reference or no_prediction):
        parts = []
        if no_reference:
            parts.append(f"{_count(len(no_reference), 'prediction')} no reference in {str(ref)!r}: "
                         f"{_listed(no_reference)}")
        if no_prediction:
            parts.append(f"{_count(len(no_prediction), 'reference')} no prediction in {str(pred)!r}: "
                         f"{_listed(no_prediction)}")
        raise DataError("; ".join(parts) + f". Pass {{evaluate.allow_missing}} to evaluate only the "
                        f"{format_count(len(both), 'case')} in both.")
    return both, no_reference, no_prediction


def _checked_classes(classes: Sequence[int] | None, num_classes: int | None) -> list[int] | None:
    if classes is None:
        return None
    classes = sorted({int(c) for c in classes})
    if not classes or classes[0] < 1:
        raise UsageError(f"Invalid {{evaluate.classes}} {classes}: expected foreground labels >= 1 (background is not "
                         "evaluated).")
    limit = num_classes - 1 if num_classes is not None else MAX_LABEL
    if classes[-1] > limit:
        raise UsageError(f"Invalid {{evaluate.classes}} {classes}: label {classes[-1]} > {limit}, the largest label "
                         f"(expected 1..{limit}).")
    return classes


def _check_labels(label: np.ndarray, num_classes: int | None, case_id: str, what: str, where: str) -> None:
    if num_classes is not None and label.size and int(label.max()) >= num_classes:
        raise DataError(f"Case {case_id!r}: {what} label value {int(label.max())} >= number of classes {num_classes} "
                        f"({where}); expected values 0..{num_classes - 1}.")


def _json_ready(value):
    """NaN -> None (JSON has no NaN), numpy scalars -> Python numbers, int keys -> str."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def _summary(pred: Path, ref: Path, wanted: list[int], label_names: Sequence[str], regions: dict,
             records: list[dict], per_case: list[dict], per_case_regions: list[dict]) -> dict:
    """summary.json's figures: each case's metrics per class (and region), and their means."""
    for record, metrics, in_regions in zip(records, per_case, per_case_regions):
        record["metrics"] = {c: metrics[c] for c in wanted}
        if regions:
            record["region_metrics"] = in_regions
    summary = {
        "pred": str(pred), "ref": str(ref), "empty_rule": EMPTY_RULE, "classes": wanted,
        "label_names": {c: label_names[c] if c < len(label_names) else f"class{c}" for c in wanted},
        "regions": regions, "num_cases": len(records), "metric_per_case": records, **aggregate(per_case, wanted),
    }
    if regions:
        region_means = aggregate(per_case_regions, list(regions))
        summary.update({"region_mean": region_means["mean"], "region_foreground_mean": region_means["foreground_mean"],
                        "region_foreground_mean_defined": region_means["foreground_mean_defined"],
                        "region_num_undefined": region_means["num_undefined"]})
    return summary


def evaluate(pred: str | os.PathLike, ref: str | os.PathLike, *, classes: Sequence[int] | None = None,
             num_classes: int | None = None, allow_missing: bool = False, out: str | os.PathLike | None = None,
             hausdorff: bool = True, run: str | os.PathLike | None = None, warn: Callable[[str], None] | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Compare every predicted label map with its reference; optionally write ``summary.json``.

    Args:
        pred: folder of predicted label maps, ``<case>.nii.gz`` or ``<case>.nii`` (integer labels).
        ref: the references under the case ids ``bigmem predict`` writes: a dataset folder, KiTS case
            folders, a folder of label maps or a store (``.h5``), as the module docstring says.
        classes: foreground labels to evaluate; default: ``1..num_classes - 1`` where the number of
            classes is known (a store, ``run`` or ``num_classes``), else ``1..`` the largest label seen.
        num_classes: labels are ``0..num_classes - 1``; a larger value is an error. Default: the
            store's, else the run's model's, else unchecked (up to 255) for a folder.
        allow_missing: evaluate only the cases on both sides instead of failing (the summary lists the rest).
        out: where to write ``summary.json`` (atomically); None writes nothing.
        hausdorff: compute HD95 (most of the time on large volumes); False leaves it null.
        run: the run directory that made the predictions: its model's number of classes, and the class
            names and regions it was trained with (its ``preprocessing.json``, or its store).
        warn: called with a one-line message for each warning (affines that differ, ...).
        progress: called with the case id after each case.

    Returns:
        The summary, as ``summary.json`` holds it (the module docstring lists its keys).

    Raises:
        DataError: a missing folder or file, a REF folder with no label map (``layouts.list_labels``), two
            label maps of one case, cases on one side only (without ``allow_missing``), prediction and
            reference shapes that differ, non-integer labels, labels >= the number of classes, regions not of
            the form ``store.checked_regions`` accepts, ``run`` not a run directory or trained on a store with
            another number of classes than REF's.
        UsageError: ``classes`` outside ``1..num_classes - 1``, or ``num_classes`` not the store's or run's.

    Example:
        >>> summary = evaluate("runs/x/predictions", "Task04/labelsTr", out="runs/x/predictions/summary.json")
        >>> summary["foreground_mean"]["Dice"]
    """
    pred, ref = Path(pred), Path(ref)
    pred_files = _prediction_files(pred)
    warnings: list[str] = []
    warning = _collector(warnings, warn)
    run_classes, run_names, run_regions = _run_labels(Path(run), warning) if run is not None else (None, [], {})
    references = _open_references(ref, warning)
    try:
        num_classes = _resolved_num_classes(num_classes, references.num_classes, run_classes, ref, run)
        label_names = references.label_names or run_names
        regions = references.regions or run_regions
        wanted = _checked_classes(classes, num_classes)
        if wanted is None and num_classes is not None:
            wanted = list(range(1, num_classes))
        case_ids, no_reference, no_prediction = _matched(pred_files, references, pred, ref, allow_missing, warning)
        per_case, per_case_regions, records, largest = _score_cases(
            case_ids, pred_files, references, num_classes, wanted, regions, hausdorff, warning, progress)
    finally:
        references.close()
    if wanted is None:  # classes from the data: a class a case never shows is absent from both maps
        wanted = _classes_seen(per_case, largest, warning)
    summary = _summary(pred, ref, wanted, label_names, regions, records, per_case, per_case_regions)
    summary.update({"missing": {"no_reference": no_reference, "no_prediction": no_prediction}, "warnings": warnings})
    return _written(_json_ready(summary), out)


def _collector(warnings: list[str], warn: Callable[[str], None] | None) -> Callable[[str], None]:
    """A ``warning(message)`` that keeps each message in ``warnings`` and passes it to ``warn``."""
    def warning(message: str) -> None:
        warnings.append(message)
        if warn is not None:
            warn(message)
    return warning


def _written(summary: dict, out: str | os.PathLike | None) -> dict:
    """``summary``, written to ``out`` (atomically) unless it is None."""
    if out is not None:
        from bigmem.atomic import atomic_write_json

        atomic_write_json(out, summary)
    return summary


def _matched(pred_files, references, pred: Path, ref: Path, allow_missing: bool, warning) -> tuple:
    """``_match``'s cases in both, and on one side only, each side's missing ones named in a warning."""
    case_ids, no_reference, no_prediction = _match(list(pred_files), references.case_ids, pred, ref, allow_missing)
    for kind, ids in (("reference", no_reference), ("prediction", no_prediction)):
        if ids:
            warning(f"{_count(len(ids), 'case')} no {kind} and {'is' if len(ids) == 1 else 'are'} not evaluated: "
                    f"{_listed(ids)} (all listed in the summary's 'missing').")
    return case_ids, no_reference, no_prediction


def _score_cases(case_ids, pred_files, references, num_classes, wanted, regions, hausdorff, warning, progress):
    """Each case's metrics per class and per region, its record, and the largest label any case holds."""
    per_case, per_case_regions, records, largest = [], [], [], 0
    for case_id in case_ids:
        metrics, in_regions, record, case_max = _score_case(case_id, pred_files[case_id], references, num_classes,
                                                            wanted, regions, hausdorff, warning)
        per_case.append(metrics)
        per_case_regions.append(in_regions)
        records.append(record)
        largest = max(largest, case_max)
        if progress is not None:
            progress(case_id)
    return per_case, per_case_regions, records, largest


def _classes_seen(per_case: list[dict], largest: int, warning) -> list[int]:
    """The classes ``1..largest`` (none given, none known): a class a case never shows is absent from both of its
    maps (``absent_class_metrics``)."""
    wanted = list(range(1, largest + 1))
    for metrics in per_case:
        for c in wanted:
            metrics.setdefault(c, absent_class_metrics())
    if not wanted:
        warning("No foreground label in any prediction or reference: nothing to evaluate.")
    return wanted


def _resolved_num_classes(given: int | None, of_store: int | None, of_run: int | None, ref: Path,
                          run: str | os.PathLike | None) -> int | None:
    """The number of classes: ``given``, else the store's, else the run's; any two that differ are refused."""
    if given is not None and of_store is not None and given != of_store:
        raise UsageError(f"Invalid {{evaluate.num_classes}} {given}: store {str(ref)!r} has {of_store} classes; drop "
                         "{evaluate.num_classes}.")
    if given is not None and of_run is not None and given != of_run:
        raise UsageError(f"Invalid {{evaluate.num_classes}} {given}: run {str(run)!r} has {of_run} classes; drop "
                         "{evaluate.num_classes}.")
    if of_store is not None and of_run is not None and of_store != of_run:
        raise DataError(f"Run {str(run)!r} has {of_run} classes but store REF {str(ref)!r} has {of_store}; expected "
                        "the store the run was trained on (or one converted like it).")
    return next((n for n in (given, of_store, of_run) if n is not None), None)


def _score_case(case_id: str, pred_path: Path, references, num_classes: int | None, classes: list[int] | None,
                regions: dict[str, list[int]], hausdorff: bool, warning: Callable[[str], None]):
    """(metrics per class, per region, the case's record, its largest label) for one pair, checked."""
    prediction, pred_affine, _ = read_label_map(pred_path, case_id, "prediction")
    reference, ref_affine, spacing, where = references.load(case_id)
    if prediction.shape != reference.shape:
        raise DataError(f"Case {case_id!r}: prediction shape {prediction.shape} != reference shape {reference.shape} "
                        f"({pred_path} vs {where}); expected the prediction on the reference's voxel grid.")
    if len(spacing) != 3 or min(spacing) <= 0:
        raise DataError(f"Case {case_id!r}: reference voxel spacing {spacing} ({where}); expected three positive "
                        "sizes in mm (the NIfTI header's pixdim).")
    _check_labels(prediction, num_classes, case_id, "prediction", str(pred_path))
    _check_labels(reference, num_classes, case_id, "reference", where)
    _warn_affine(pred_affine, ref_affine, case_id, where, warning)
    case_max = max(int(prediction.max(initial=0)), int(reference.max(initial=0)))
    metrics = case_metrics(reference, prediction, classes if classes is not None else range(1, case_max + 1),
                           spacing, hausdorff=hausdorff)
    in_regions = region_metrics(reference, prediction, regions, spacing, hausdorff=hausdorff) if regions else {}
    record = {"case_id": case_id, "prediction_file": str(pred_path), "reference_file": where,
              "spacing_mm": list(spacing)}
    return metrics, in_regions, record, case_max


def _warn_affine(pred_affine: np.ndarray, ref_affine: np.ndarray, case_id: str, where: str, warning) -> None:
    from bigmem.data.nifti import AFFINE_TOLERANCE_MM

    worst = float(np.abs(pred_affine - ref_affine).max())
    if worst > AFFINE_TOLERANCE_MM:
        warning(f"Case {case_id!r}: prediction affine differs from the reference's ({where}) by {worst:.3g} "
                f"(tolerance {AFFINE_TOLERANCE_MM}); compared voxel for voxel anyway.")
