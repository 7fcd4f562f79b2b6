"""Validation scores what predict + evaluate score: on a resampled store, against the original label files,
per class and per region."""

from __future__ import annotations

import json

import h5py
import nibabel as nib
import numpy as np
import pytest

from bigmem.data.convert import convert
from bigmem.data.nifti import SourceCase, SourceDataset
from bigmem.infer.evaluate import evaluate, store_reference
from bigmem.infer.geometry import CaseGeometry, source_label_from_store
from bigmem.rundir import read_jsonl
from helpers import run_cli

# 1.3 x 1.7 x 2.3 mm voxels resampled to 1.5 mm: one axis finer, two coarser (labels lose voxels there)
AFFINE = np.diag([1.3, 1.7, 2.3, 1.0])
SPACING = (1.5, 1.5, 1.5)
REGIONS = {"lesion": [1, 2], "core": [2]}


def _dataset(root):
    """Three 17x13x11 cases with two nested blobs; images are labels plus noise."""
    rng = np.random.default_rng(3)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    cases = []
    for index in range(3):
        grid = np.stack(np.meshgrid(*[np.arange(s) for s in (17, 13, 11)], indexing="ij"), -1)
        centre = np.array([8.0, 6.0, 5.0]) + rng.uniform(-1, 1, 3)
        radius = np.linalg.norm((grid - centre) * [1.3, 1.7, 2.3], axis=-1)
        label = np.where(radius < 9.0, 1, 0).astype(np.uint8)
        label[radius < 4.5] = 2
        image = (rng.normal(0, 1, label.shape) + 2 * label).astype(np.float32)
        image_path, label_path = root / "imagesTr" / f"c{index}.nii.gz", root / "labelsTr" / f"c{index}.nii.gz"
        nib.save(nib.Nifti1Image(image, AFFINE), str(image_path))
        nib.save(nib.Nifti1Image(label, AFFINE), str(label_path))
        cases.append(SourceCase(f"c{index}", image_path, label_path))
    return SourceDataset(cases, ["image"], ["background", "outer", "inner"], str(root))


def test_val_dice_of_a_resampled_store_is_predict_and_evaluate_against_the_original_labels(tmp_path, capsys):
    source = tmp_path / "src"
    store = tmp_path / "store.h5"
    convert(_dataset(source), store, spacing=SPACING)
    with h5py.File(store, "r+") as handle:  # the regions scored: in the store, and in an nnU-Net dataset.json
        handle.attrs["regions"] = json.dumps(REGIONS)
    (source / "dataset.json").write_text(json.dumps({"channel_names": {"0": "image"}, "file_ending": ".nii.gz",
                                                     "labels": {"background": 0, "lesion": [1, 2], "core": 2}}))
    geometry = CaseGeometry.from_store(store, "c2")
    assert geometry.resampled
    assert not geometry.lossless
    original = np.asanyarray(nib.load(str(source / "labelsTr" / "c2.nii.gz")).dataobj)
    mapped_back, _, _ = source_label_from_store(store, "c2")
    assert not np.array_equal(mapped_back, original)  # the store's label is not the original: this test can fail
    reference, _, _, where = store_reference(store, "c2")
    np.testing.assert_array_equal(reference, original)
    assert where == str(source / "labelsTr" / "c2.nii.gz")

    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "tiny", "--data", store, "--steps", 3, "--holdout", 1,
                            "--val-every", 3, "--lr", "1e-2", "--out", run], capsys)
    assert code == 0, err
    val = json.loads((run / "summary.json").read_text())
    validated = [r for r in read_jsonl(run / "metrics.jsonl") if "val_dice" in r]
    assert [r["step"] for r in validated] == [3]
    assert validated[0]["val_dice_per_region"] == val["val_dice_per_region"]
    assert list(val["val_dice_per_region"]) == ["lesion", "core"]
    code, _, err = run_cli(["predict", run, store, "--cases", "c2", "-o", tmp_path / "pred", "--mode", "whole",
                            "--force"], capsys)
    assert code == 0, err
    prediction = np.asanyarray(nib.load(str(tmp_path / "pred" / "c2.nii.gz")).dataobj)
    assert prediction.shape == original.shape
    for ref in (source / "labelsTr", store):  # the original label files, and the store (which reads them)
        summary = evaluate(tmp_path / "pred", ref, allow_missing=True, hausdorff=False)
        assert summary["metric_per_case"][0]["reference_file"] == str(source / "labelsTr" / "c2.nii.gz")
        assert summary["foreground_mean_defined"]["Dice"] == pytest.approx(val["val_dice"], abs=1e-6)
        for label, dice in val["val_dice_per_class"].items():
            assert summary["mean"][label]["Dice"] == pytest.approx(dice, abs=1e-6)
        assert summary["regions"] == REGIONS
        for region, dice in val["val_dice_per_region"].items():
            assert summary["region_mean"][region]["Dice"] == pytest.approx(dice, abs=1e-6)
    # the class a prediction and its reference share is scored against the original, not the store's label
    predicted_voxels = [np.count_nonzero(prediction == c) for c in (1, 2)]
    by_hand = [2 * np.count_nonzero((prediction == c) & (original == c))
               / (np.count_nonzero(original == c) + predicted_voxels[c - 1]) for c in (1, 2)]
    assert [val["val_dice_per_class"][str(c)] for c in (1, 2)] == pytest.approx(by_hand, abs=1e-12)
    lesion = 2 * np.count_nonzero((prediction > 0) & (original > 0)) / (np.count_nonzero(prediction > 0)
                                                                         + np.count_nonzero(original > 0))
    assert val["val_dice_per_region"]["lesion"] == pytest.approx(lesion, abs=1e-12)
    assert val["val_dice_per_region"]["core"] == pytest.approx(by_hand[1], abs=1e-12)  # one label: the class


def test_source_labels_are_read_where_convert_changed_the_label_else_the_store_is_exact(tmp_path):
    source = tmp_path / "src"
    store = tmp_path / "store.h5"
    convert(_dataset(source), store, spacing=SPACING)
    (source / "labelsTr" / "c1.nii.gz").unlink()
    warnings = []
    label, affine, spacing, where = store_reference(store, "c1", warn=warnings.append)
    mapped_back, _, _ = source_label_from_store(store, "c1")
    np.testing.assert_array_equal(label, mapped_back)
    assert where == f"{store}:c1"
    assert warnings == [f"Case 'c1': the store's label was resampled by convert's --spacing and its source label "
                        f"{str(source / 'labelsTr' / 'c1.nii.gz')!r} is gone; scored against the store's label mapped "
                        "back to the source grid (close to the source label, not equal)."]
    # a case convert neither resampled nor cropped reads no file: the store's label is exact
    plain = tmp_path / "plain.h5"
    convert(_dataset(tmp_path / "src2"), plain)
    (tmp_path / "src2" / "labelsTr" / "c0.nii.gz").unlink()
    label, _, _, where = store_reference(plain, "c0", warn=warnings.append)
    assert where == f"{plain}:c0"
    assert len(warnings) == 1
    np.testing.assert_array_equal(label, source_label_from_store(plain, "c0")[0])
    # a case whose --shape crop cut voxels away is scored against its source label file, cut-away voxels too
    cropped = tmp_path / "cropped.h5"
    convert(_dataset(tmp_path / "src3"), cropped, shape=(12, 12, 12))  # 17x13x11: two axes cropped, one padded
    original = np.asanyarray(nib.load(str(tmp_path / "src3" / "labelsTr" / "c0.nii.gz")).dataobj)
    assert not np.array_equal(source_label_from_store(cropped, "c0")[0], original)
    label, _, _, where = store_reference(cropped, "c0", warn=warnings.append)
    assert where == str(tmp_path / "src3" / "labelsTr" / "c0.nii.gz")
    assert len(warnings) == 1
    np.testing.assert_array_equal(label, original)


def test_training_warns_once_when_a_held_out_source_label_is_gone(tmp_path, capsys):
    source = tmp_path / "src"
    store = tmp_path / "store.h5"
    convert(_dataset(source), store, spacing=SPACING)
    (source / "labelsTr" / "c2.nii.gz").unlink()
    code, out, err = run_cli(["train", "--model", "tiny", "--data", store, "--steps", 2, "--holdout", 1,
                              "--val-every", 1, "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    assert out.count("validation at step ") == 2
    assert out.count("warning: Case 'c2': the store's label was resampled by convert's --spacing and its source "
                     "label") == 1
    assert "val_dice_per_region" not in json.loads((tmp_path / "run" / "summary.json").read_text())
