"""``bigmem evaluate``'s API: predicted label maps against references, per case and per class.

Predictions are a folder of NIfTI label maps (``<case>.nii.gz`` or ``.nii``); references are a
folder of NIfTI label maps matched by case id (:func:`label_case_id`: the file name) or a bigmem
HDF5 store, whose labels are compared in the source geometry
(:func:`bigmem.infer.geometry.source_label_from_store`). Both are compared voxel for voxel as
stored (no reorientation), with the reference's spacing. The summary follows nnU-Net v2's
``summary.json`` (``metric_per_case``, ``mean``, ``foreground_mean``); undefined values
(:data:`bigmem.infer.metrics.EMPTY_RULE`) are written as null.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bigmem.errors import DataError, UsageError
from bigmem.infer.metrics import EMPTY_RULE, absent_class_metrics, aggregate, case_metrics

MAX_LABEL = 255  # label maps are held as uint8, as in the store (README.md, "The store format")
_SLAB_PLANES = 16  # float label files are checked 16 planes at a time: temporaries of a slab, not a volume


def label_case_id(path: Path) -> str:
    """The case id of a label map file: its name without ``.nii.gz``/``.nii``.

    Unlike :func:`bigmem.data.nifti.case_id_of` (for image files), a trailing ``_0000`` is kept: label
    maps carry no channel suffix (nnU-Net's ``labelsTr/CASE.nii.gz``), and ``patient_0001.nii.gz`` is
    case ``patient_0001``, as the store names the case of ``patient_0001_0000.nii.gz``.

    Example:
        >>> label_case_id(Path("labelsTr/patient_0001.nii.gz"))
        'patient_0001'
    """
    return path.name.removesuffix(".gz").removesuffix(".nii")


def _nifti_files(folder: Path, what: str) -> dict[str, Path]:
    """case id -> file for the ``.nii``/``.nii.gz`` files directly in ``folder``."""
    if not folder.is_dir():
        raise DataError(f"{what} {str(folder)!r} is not a folder: expected a folder of NIfTI label maps "
                        "(<case>.nii.gz)" + (" or a bigmem store (.h5)." if what == "REF" else "."))
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not path.name.endswith((".nii", ".nii.gz")):
            continue
        case_id = label_case_id(path)
        if case_id in files:
            raise DataError(f"Case {case_id!r}: two files in {what} {str(folder)!r} ({files[case_id].name}, "
                            f"{path.name}); expected one label map per case.")
        files[case_id] = path
    if not files:
        raise DataError(f"{what} {str(folder)!r} holds no .nii or .nii.gz file.")
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


class _FolderReferences:
    """References from a folder of NIfTI label maps."""

    def __init__(self, folder: Path):
        self.files = _nifti_files(folder, "REF")
        self.case_ids = list(self.files)
        self.num_classes: int | None = None
        self.label_names: list[str] = []

    def where(self, case_id: str) -> str:
        return str(self.files[case_id])

    def load(self, case_id: str):
        return read_label_map(self.files[case_id], case_id, "reference")

    def close(self) -> None:
        pass


class _StoreReferences:
    """References from a bigmem store: its labels mapped back to the source geometry."""

    def __init__(self, path: Path):
        from bigmem.data.store import HDF5VolumeStore

        self.store = HDF5VolumeStore(path)
        self.case_ids = self.store.case_ids
        self.num_classes: int | None = self.store.num_classes
        self.label_names = self.store.label_names

    def where(self, case_id: str) -> str:
        return f"{self.store.path}:{case_id}"

    def load(self, case_id: str):
        from bigmem.infer.geometry import source_label_from_store

        label, affine, spacing = source_label_from_store(self.store, case_id)
        label = _as_label_map(np.asarray(label), case_id, "reference", self.where(case_id))
        return label, np.asarray(affine, np.float64), tuple(float(s) for s in spacing)

    def close(self) -> None:
        self.store.close()


def _open_references(ref: Path):
    if ref.suffix == ".h5" or ref.is_file():
        return _StoreReferences(ref)
    return _FolderReferences(ref)


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
        raise DataError("; ".join(parts) + f". Pass --allow-missing to evaluate only the {len(both)} cases in both.")
    return both, no_reference, no_prediction


def _checked_classes(classes: Sequence[int] | None, num_classes: int | None) -> list[int] | None:
    if classes is None:
        return None
    classes = sorted({int(c) for c in classes})
    if not classes or classes[0] < 1:
        raise UsageError(f"Invalid --classes {classes}: expected foreground labels >= 1 (background is not "
                         "evaluated).")
    limit = num_classes - 1 if num_classes is not None else MAX_LABEL
    if classes[-1] > limit:
        raise UsageError(f"Invalid --classes {classes}: label {classes[-1]} > {limit}, the largest label "
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


def evaluate(pred: str | os.PathLike, ref: str | os.PathLike, *, classes: Sequence[int] | None = None,
             num_classes: int | None = None, allow_missing: bool = False, out: str | os.PathLike | None = None,
             hausdorff: bool = True, warn: Callable[[str], None] | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Compare every predicted label map with its reference; optionally write ``summary.json``.

    Args:
        pred: folder of predicted label maps, ``<case>.nii.gz`` or ``<case>.nii`` (integer labels).
        ref: folder of reference label maps with the same case ids, or a bigmem store (``.h5``).
        classes: foreground labels to evaluate; default: ``1..num_classes - 1`` where the number of
            classes is known (a store, or ``num_classes``), else ``1..`` the largest label seen.
        num_classes: labels are ``0..num_classes - 1``; a larger value is an error. Default: the
            store's, or unchecked (up to 255) for a folder.
        allow_missing: evaluate only the cases in both PRED and REF instead of failing when a
            case is on one side only (the missing ones are listed in the summary).
        out: where to write ``summary.json`` (atomically); None writes nothing.
        hausdorff: compute HD95 (most of the time on large volumes); False leaves it null.
        warn: called with a one-line message for each warning (affines that differ, ...).
        progress: called with the case id after each case.

    Returns:
        The summary: ``{"pred", "ref", "empty_rule", "classes", "label_names", "num_cases",
        "metric_per_case": [{"case_id", "prediction_file", "reference_file", "spacing_mm",
        "metrics": {class: {"Dice", "IoU", "TP", "FP", "FN", "n_ref", "n_pred", "ref_volume_ml",
        "pred_volume_ml", "HD95_mm"}}}], "mean": {class: {metric: ...}}, "foreground_mean":
        {metric: ...}, "num_undefined": {class: {"Dice", "IoU", "HD95_mm"}}, "missing":
        {"no_reference", "no_prediction"}, "warnings": [...]}``, with class keys as strings and
        undefined values as None (it is what ``summary.json`` holds).

    Raises:
        DataError: a missing folder or file, cases on one side only (without ``allow_missing``),
            prediction and reference shapes that differ, non-integer labels, labels >= the number
            of classes.
        UsageError: ``classes`` outside ``1..num_classes - 1``.

    Example:
        >>> summary = evaluate("runs/x/predictions", "Task04/labelsTr", out="runs/x/predictions/summary.json")
        >>> summary["foreground_mean"]["Dice"]
    """
    from bigmem.rundir import atomic_write_json

    pred, ref = Path(pred), Path(ref)
    pred_files = _nifti_files(pred, "PRED")
    references = _open_references(ref)
    warnings: list[str] = []

    def warning(message: str) -> None:
        warnings.append(message)
        if warn is not None:
            warn(message)

    try:
        if num_classes is None:
            num_classes = references.num_classes
        elif references.num_classes is not None and num_classes != references.num_classes:
            raise UsageError(f"Invalid --num-classes {num_classes}: store {str(ref)!r} has {references.num_classes} "
                             "classes; drop --num-classes.")
        wanted = _checked_classes(classes, num_classes)
        if wanted is None and num_classes is not None:
            wanted = list(range(1, num_classes))
        case_ids, no_reference, no_prediction = _match(list(pred_files), references.case_ids, pred, ref,
                                                       allow_missing)
        for kind, ids in (("reference", no_reference), ("prediction", no_prediction)):
            if ids:
                warning(f"{_count(len(ids), 'case')} no {kind} and {'is' if len(ids) == 1 else 'are'} not evaluated: "
                        f"{_listed(ids)} (all listed in the summary's 'missing').")
        per_case, records, largest = [], [], 0
        for case_id in case_ids:
            metrics, record, case_max = _score_case(case_id, pred_files[case_id], references, num_classes, wanted,
                                                    hausdorff, warning)
            per_case.append(metrics)
            records.append(record)
            largest = max(largest, case_max)
            if progress is not None:
                progress(case_id)
    finally:
        references.close()
    if wanted is None:  # classes from the data: a class a case never shows is absent from both maps
        wanted = list(range(1, largest + 1))
        for metrics in per_case:
            for c in wanted:
                metrics.setdefault(c, absent_class_metrics())
        if not wanted:
            warning("No foreground label in any prediction or reference: nothing to evaluate.")
    for record, metrics in zip(records, per_case):
        record["metrics"] = {c: metrics[c] for c in wanted}
    means = aggregate(per_case, wanted)
    summary = {
        "pred": str(pred), "ref": str(ref), "empty_rule": EMPTY_RULE, "classes": wanted,
        "label_names": {c: references.label_names[c] for c in wanted if c < len(references.label_names)},
        "num_cases": len(records), "metric_per_case": records, **means,
        "missing": {"no_reference": no_reference, "no_prediction": no_prediction}, "warnings": warnings,
    }
    summary = _json_ready(summary)
    if out is not None:
        atomic_write_json(out, summary)
    return summary


def _score_case(case_id: str, pred_path: Path, references, num_classes: int | None, classes: list[int] | None,
                hausdorff: bool, warning: Callable[[str], None]):
    """(metrics per class, the case's record, its largest label) for one prediction/reference pair, checked."""
    prediction, pred_affine, _ = read_label_map(pred_path, case_id, "prediction")
    reference, ref_affine, spacing = references.load(case_id)
    where = references.where(case_id)
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
    record = {"case_id": case_id, "prediction_file": str(pred_path), "reference_file": where,
              "spacing_mm": list(spacing)}
    return metrics, record, case_max


def _warn_affine(pred_affine: np.ndarray, ref_affine: np.ndarray, case_id: str, where: str, warning) -> None:
    from bigmem.data.nifti import AFFINE_TOLERANCE_MM

    worst = float(np.abs(pred_affine - ref_affine).max())
    if worst > AFFINE_TOLERANCE_MM:
        warning(f"Case {case_id!r}: prediction affine differs from the reference's ({where}) by {worst:.3g} "
                f"(tolerance {AFFINE_TOLERANCE_MM}); compared voxel for voxel anyway.")
