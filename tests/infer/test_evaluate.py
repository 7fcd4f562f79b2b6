"""bigmem.infer.evaluate's API: label maps read and checked, and per-case and mean scores with known answers.

The command (``bigmem evaluate``: flags, printing, exit codes) is tests/cli/test_evaluate_command.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from bigmem.errors import DataError, UsageError
from bigmem.infer.evaluate import evaluate, label_case_id, read_label_map, store_reference

SPACING = (2.0, 1.0, 0.5)  # 1 mm^3 a voxel: 0.001 mL; planes along the first axis are 2 mm apart
SHAPE = (6, 5, 4)  # a plane along the first axis holds 5 x 4 = 20 voxels


def _write(path: Path, data, spacing=SPACING, affine=None) -> Path:
    data = np.asarray(data)
    image = nib.Nifti1Image(data, np.diag([*spacing, 1.0]) if affine is None else affine)
    image.header.set_zooms(spacing + (1.0,) * (data.ndim - 3))
    nib.save(image, str(path))
    return path


def _labels(*boxes) -> np.ndarray:
    """A SHAPE uint8 label map: ``boxes`` are (label, index expression), later ones on top."""
    out = np.zeros(SHAPE, np.uint8)
    for label, where in boxes:
        out[where] = label
    return out


@pytest.fixture
def known(tmp_path):
    """Two cases of classes 1-3 whose scores are worked out by hand in test_per_case_scores_by_hand."""
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    corner = np.s_[5, 0:2, 0:2]  # 4 voxels
    # a: class 1 is plane 1 in the reference and plane 3 in the prediction (no overlap, 2 planes = 4 mm apart);
    # class 2 is the same 4 voxels in both
    _write(ref / "a.nii.gz", _labels((1, np.s_[1]), (2, corner)))
    _write(pred / "a.nii.gz", _labels((1, np.s_[3]), (2, corner)))
    # b: class 1 is plane 0 in both; class 2 is in neither
    _write(ref / "b.nii.gz", _labels((1, np.s_[0])))
    _write(pred / "b.nii.gz", _labels((1, np.s_[0])))
    return pred, ref  # class 3: in no map at all


# ---- label maps --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, case_id", [("case_7.nii.gz", "case_7"), ("case_7.nii", "case_7"),
                                           ("patient_0001.nii.gz", "patient_0001"),  # no channel suffix to strip
                                           ("a.b.nii.gz", "a.b")])
def test_label_case_id_is_the_file_name_without_its_nifti_suffix(name, case_id):
    assert label_case_id(Path("labelsTr") / name) == case_id


@pytest.mark.parametrize("data", [np.eye(4, dtype=np.int16)[:, :, None].repeat(3, 2),
                                  np.eye(4, dtype=np.float32)[:, :, None].repeat(3, 2) * 2,  # integral floats
                                  np.eye(4, dtype=np.uint8)[:, :, None, None].repeat(3, 2)])  # (X, Y, Z, 1)
def test_read_label_map_gives_uint8_labels_whatever_the_file_stores(tmp_path, data):
    label, affine, spacing = read_label_map(_write(tmp_path / "c.nii.gz", data), "c", "reference")
    assert label.dtype == np.uint8
    assert label.shape == (4, 4, 3)
    np.testing.assert_array_equal(label, data.reshape(4, 4, 3).astype(np.uint8))
    np.testing.assert_array_equal(affine, np.diag([*SPACING, 1.0]))
    assert spacing == SPACING


@pytest.mark.parametrize("data, message", [
    (np.zeros((4, 4), np.uint8),
     r"^Case 'c': prediction has shape \(4, 4\) \(.*c\.nii\.gz\); expected a 3D label map\.$"),
    (np.full((2, 2, 2), 0.5, np.float32), r"^Case 'c': prediction has non-integer label values \(e\.g\. 0\.5\) "
                                          r"\(.*\); expected a label map, not probabilities\.$"),
    (np.full((2, 2, 2), -1000, np.int16), r"^Case 'c': prediction .*c\.nii\.gz looks like an image, not a label map: "
                                          r"values -1000\.\.-1000; expected labels 0\.\.255"),
])
def test_read_label_map_refuses_what_is_not_a_label_map(tmp_path, data, message):
    path = tmp_path / "c.nii.gz"
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(path))
    with pytest.raises(DataError, match=message):
        read_label_map(path, "c", "prediction")


def test_read_label_map_names_a_truncated_file(tmp_path):
    path = _write(tmp_path / "c.nii.gz", _labels())
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match=r"^Case 'c': cannot read reference '.*c\.nii\.gz' \(.*\); the file may be "
                                        r"truncated or not NIfTI\.$"):
        read_label_map(path, "c", "reference")


def test_store_reference_of_a_lossless_case_is_the_stores_label(tiny_store):
    """The phantoms are stored as they were made (not resampled, not cropped): no file is read."""
    from bigmem.data.store import HDF5VolumeStore

    label, affine, spacing, where = store_reference(tiny_store, "synth_0002")
    with HDF5VolumeStore(tiny_store) as store:
        stored = store.read_case("synth_0002")[1]
    np.testing.assert_array_equal(label, stored)
    assert label.dtype == np.uint8
    np.testing.assert_array_equal(affine, np.eye(4))
    assert spacing == (1.0, 1.0, 1.0)
    assert where == f"{tiny_store}:synth_0002"


# ---- scores ------------------------------------------------------------------------------------


def test_per_case_scores_by_hand(known):
    pred, ref = known
    summary = evaluate(pred, ref, num_classes=4)
    assert summary["classes"] == [1, 2, 3]
    cases = {case["case_id"]: case["metrics"] for case in summary["metric_per_case"]}
    a1 = cases["a"]["1"]
    assert (a1["TP"], a1["FP"], a1["FN"]) == (0, 20, 20)
    assert a1["Dice"] == 0.0
    assert a1["IoU"] == 0.0
    assert a1["HD95_mm"] == pytest.approx(4.0)  # every surface voxel is two planes (2 x 2 mm) from the other's
    assert a1["ref_volume_ml"] == pytest.approx(0.02)
    a2 = cases["a"]["2"]
    assert (a2["TP"], a2["Dice"], a2["HD95_mm"]) == (4, 1.0, 0.0)
    b1 = cases["b"]["1"]
    assert (b1["TP"], b1["Dice"], b1["HD95_mm"]) == (20, 1.0, 0.0)
    b2 = cases["b"]["2"]  # in neither map: undefined, null in JSON
    assert (b2["Dice"], b2["IoU"], b2["HD95_mm"]) == (None, None, None)
    assert (b2["TP"], b2["FP"], b2["FN"]) == (0, 0, 0)


def test_means_leave_undefined_cases_out_and_count_them(known):
    pred, ref = known
    summary = evaluate(pred, ref, num_classes=4)
    assert summary["mean"]["1"]["Dice"] == pytest.approx(0.5)  # (0 + 1) / 2
    assert summary["mean"]["1"]["HD95_mm"] == pytest.approx(2.0)  # (4 + 0) / 2
    assert summary["mean"]["2"]["Dice"] == 1.0  # case b's undefined Dice is left out, not a 0 or a 1
    assert summary["mean"]["3"]["Dice"] is None  # undefined in every case
    assert summary["num_undefined"] == {"1": {"Dice": 0, "IoU": 0, "HD95_mm": 0},
                                        "2": {"Dice": 1, "IoU": 1, "HD95_mm": 1},
                                        "3": {"Dice": 2, "IoU": 2, "HD95_mm": 2}}


def test_foreground_mean_is_nnunets_and_foreground_mean_defined_leaves_undefined_classes_out(known):
    """nnU-Net v2's foreground mean is the plain mean of the class means: undefined if one class is."""
    pred, ref = known
    summary = evaluate(pred, ref, num_classes=4)
    assert summary["foreground_mean"]["Dice"] is None  # class 3's mean is undefined
    assert summary["foreground_mean"]["TP"] == pytest.approx((10 + 2 + 0) / 3)  # counts are always defined
    assert summary["foreground_mean_defined"]["Dice"] == pytest.approx((0.5 + 1.0) / 2)
    assert summary["foreground_mean_defined"]["HD95_mm"] == pytest.approx((2.0 + 0.0) / 2)
    defined_only = evaluate(pred, ref, num_classes=4, classes=[1, 2])
    assert defined_only["foreground_mean"]["Dice"] == pytest.approx(0.75)  # the two agree where all are defined
    assert defined_only["foreground_mean_defined"]["Dice"] == pytest.approx(0.75)


def test_a_class_on_one_side_only_scores_zero_with_no_hd95(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    _write(ref / "c.nii.gz", _labels((1, np.s_[2])))
    _write(pred / "c.nii.gz", _labels())
    metrics = evaluate(pred, ref, num_classes=2)["metric_per_case"][0]["metrics"]["1"]
    assert (metrics["Dice"], metrics["IoU"], metrics["FN"]) == (0.0, 0.0, 20)
    assert metrics["HD95_mm"] is None  # no predicted surface to measure from


def test_without_a_number_of_classes_the_classes_are_the_labels_seen(known):
    pred, ref = known
    summary = evaluate(pred, ref)  # folders: nothing says there are 4 classes
    assert summary["classes"] == [1, 2]
    assert summary["metric_per_case"][1]["metrics"]["2"]["Dice"] is None  # b shows no 2: absent from both maps


def test_hausdorff_off_leaves_every_hd95_undefined(known):
    pred, ref = known
    summary = evaluate(pred, ref, num_classes=4, hausdorff=False)
    assert [m["HD95_mm"] for case in summary["metric_per_case"] for m in case["metrics"].values()] == [None] * 6
    assert summary["metric_per_case"][0]["metrics"]["1"]["Dice"] == 0.0  # the overlap is still scored


# ---- the call ----------------------------------------------------------------------------------


def test_out_writes_the_returned_summary_and_none_writes_nothing(known, tmp_path):
    pred, ref = known
    before = sorted(p.name for p in pred.iterdir())
    summary = evaluate(pred, ref, num_classes=4)
    assert sorted(p.name for p in pred.iterdir()) == before
    out = tmp_path / "eval" / "summary.json"
    written = evaluate(pred, ref, num_classes=4, out=out)
    assert json.loads(out.read_text()) == written
    assert written == summary


def test_progress_and_warnings_are_called_back(known):
    pred, ref = known
    shifted = np.diag([*SPACING, 1.0])
    shifted[0, 3] = 5.0  # 5 mm off the reference's origin
    _write(pred / "b.nii.gz", _labels((1, np.s_[0])), affine=shifted)
    progress, warnings = [], []
    summary = evaluate(pred, ref, num_classes=4, progress=progress.append, warn=warnings.append)
    assert progress == ["a", "b"]
    assert warnings == [f"Case 'b': prediction affine differs from the reference's ({ref / 'b.nii.gz'}) by 5 "
                        "(tolerance 0.001); compared voxel for voxel anyway."]
    assert summary["warnings"] == warnings


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_classes=4, classes=[3, 4]), UsageError,
     r"^Invalid evaluate\.classes \[3, 4\]: label 4 > 3, the largest label \(expected 1\.\.3\)\.$"),
    (dict(classes=[0, 1]), UsageError, r"^Invalid evaluate\.classes \[0, 1\]: expected foreground labels >= 1"),
    (dict(num_classes=2), DataError, r"^Case 'a': prediction label value 2 >= number of classes 2 \(.*a\.nii\.gz\); "
                                     r"expected values 0\.\.1\.$"),
])
def test_bad_classes_are_refused_with_what_was_expected(known, kwargs, error, message):
    pred, ref = known
    with pytest.raises(error, match=message):
        evaluate(pred, ref, **kwargs)


def test_a_prediction_on_another_grid_is_refused(known):
    pred, ref = known
    _write(pred / "a.nii.gz", np.zeros((6, 5, 3), np.uint8))
    with pytest.raises(DataError, match=r"^Case 'a': prediction shape \(6, 5, 3\) != reference shape \(6, 5, 4\) "
                                        r"\(.*\); expected the prediction on the reference's voxel grid\.$"):
        evaluate(pred, ref)


def test_a_number_of_classes_other_than_the_stores_is_refused(tiny_store, tmp_path):
    pred = tmp_path / "pred"
    pred.mkdir()
    _write(pred / "synth_0000.nii.gz", np.zeros((16, 16, 16), np.uint8), spacing=(1.0, 1.0, 1.0))
    with pytest.raises(UsageError, match=rf"^Invalid evaluate\.num_classes 4: store '{tiny_store}' has 3 classes; drop "
                                         r"evaluate\.num_classes\.$"):
        evaluate(pred, tiny_store, num_classes=4, allow_missing=True)
