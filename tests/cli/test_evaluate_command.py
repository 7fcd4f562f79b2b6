"""bigmem evaluate: summary.json values on hand-computed cases, the empty rule, regions, names, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from helpers import copy_store, run_cli

SPACING = (2.0, 1.0, 0.5)  # 1 mm^3 per voxel: volumes in mL are voxels / 1000


def _write(path, label, spacing=SPACING, dtype=np.uint8, affine=None):
    affine = np.diag(list(spacing) + [1.0]) if affine is None else affine
    image = nib.Nifti1Image(np.asarray(label, dtype=dtype), affine)
    image.header.set_zooms(spacing)
    nib.save(image, str(path))
    return path


def _box(shape, *boxes):
    out = np.zeros(shape, np.uint8)
    for label, box in boxes:
        out[box] = label
    return out


@pytest.fixture
def folders(tmp_path):
    """Two cases with classes 1 and 2 (class 2 absent from both maps of case_a), hand-computed below."""
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    shape = (8, 6, 5)
    # case_a: class 1 reference x 0..3 (4 x 6 x 5 = 120 voxels), prediction x 1..3 (90): TP 90, FN 30, FP 0
    _write(ref / "case_a.nii.gz", _box(shape, (1, np.s_[0:4])))
    _write(pred / "case_a.nii.gz", _box(shape, (1, np.s_[1:4])))
    # patient_0001 (a trailing _0001 is part of the id): class 1 identical (30 voxels); class 2 in the
    # reference only (30 voxels): Dice 0, HD95 undefined
    _write(ref / "patient_0001.nii.gz", _box(shape, (1, np.s_[0:1]), (2, np.s_[5:6])))
    _write(pred / "patient_0001.nii.gz", _box(shape, (1, np.s_[0:1])))
    return pred, ref


def test_summary_values_by_hand(folders, capsys):
    pred, ref = folders
    code, out, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["classes"] == [1, 2]
    assert summary["num_cases"] == 2
    cases = {case["case_id"]: case for case in summary["metric_per_case"]}
    a = cases["case_a"]["metrics"]
    assert (a["1"]["TP"], a["1"]["FP"], a["1"]["FN"]) == (90, 0, 30)
    assert a["1"]["Dice"] == pytest.approx(180 / 210)
    assert a["1"]["IoU"] == pytest.approx(90 / 120)
    assert a["1"]["ref_volume_ml"] == pytest.approx(0.12)
    assert a["1"]["pred_volume_ml"] == pytest.approx(0.09)
    # the x = 0 face moved one plane along x (2 mm): prediction -> reference distances are all <= 1 mm, and
    # 30 of the reference's 96 surface voxels (its x = 0 face) are 2 mm from the prediction's surface, the
    # other 66 on it: the 95th percentile is 2 mm
    assert a["1"]["HD95_mm"] == pytest.approx(2.0)
    assert a["2"] == {"Dice": None, "IoU": None, "TP": 0, "FP": 0, "FN": 0, "n_ref": 0, "n_pred": 0,
                      "ref_volume_ml": 0.0, "pred_volume_ml": 0.0, "HD95_mm": None}
    b = cases["patient_0001"]["metrics"]
    assert (b["1"]["Dice"], b["1"]["HD95_mm"]) == (1.0, 0.0)
    assert (b["2"]["Dice"], b["2"]["IoU"], b["2"]["FN"], b["2"]["HD95_mm"]) == (0.0, 0.0, 30, None)
    assert cases["case_a"]["spacing_mm"] == list(SPACING)
    assert summary["mean"]["1"]["Dice"] == pytest.approx((180 / 210 + 1.0) / 2)
    assert summary["mean"]["2"]["Dice"] == 0.0  # case_a's undefined Dice is left out, not counted as 0 or 1
    assert summary["mean"]["2"]["HD95_mm"] is None
    assert summary["foreground_mean"]["Dice"] == pytest.approx(((180 / 210 + 1.0) / 2 + 0.0) / 2)
    assert summary["foreground_mean"]["HD95_mm"] is None  # nnU-Net's plain mean: class 2 has no defined HD95
    assert summary["foreground_mean_defined"]["HD95_mm"] == pytest.approx(1.0)  # bigmem's: class 2 left out
    assert summary["num_undefined"] == {"1": {"Dice": 0, "IoU": 0, "HD95_mm": 0},
                                        "2": {"Dice": 1, "IoU": 1, "HD95_mm": 2}}
    assert summary["missing"] == {"no_reference": [], "no_prediction": []}
    assert "foreground mean" in out
    assert f"wrote {pred / 'summary.json'}" in out


def test_out_flag_and_classes_subset(folders, tmp_path, capsys):
    pred, ref = folders
    out = tmp_path / "eval" / "s.json"
    code, _, err = run_cli(["evaluate", pred, ref, "-o", out, "--classes", "2", "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads(out.read_text())
    assert summary["classes"] == [2]
    assert list(summary["mean"]) == ["2"]
    assert summary["metric_per_case"][0]["metrics"]["2"]["HD95_mm"] is None
    assert not (pred / "summary.json").exists()


def test_missing_cases_are_an_error_unless_allowed(folders, capsys):
    pred, ref = folders
    _write(ref / "case_c.nii.gz", np.zeros((8, 6, 5)))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem evaluate: error: 1 reference has no prediction in {str(pred)!r}: 'case_c'. "
                           "Pass --allow-missing to evaluate only the 2 cases in both.")
    code, out, err = run_cli(["evaluate", pred, ref, "--allow-missing"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["num_cases"] == 2
    assert summary["missing"] == {"no_reference": [], "no_prediction": ["case_c"]}
    assert "1 case has no prediction and is not evaluated: 'case_c'" in out


def test_prediction_without_reference_is_an_error(folders, capsys):
    pred, ref = folders
    _write(pred / "extra.nii", np.zeros((8, 6, 5)))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert "1 prediction has no reference in" in err
    assert "'extra'" in err
    assert len(err.strip().splitlines()) == 1


def test_no_case_in_common_is_an_error(folders, tmp_path, capsys):
    pred, _ = folders
    other = tmp_path / "other"
    other.mkdir()
    _write(other / "zzz.nii.gz", np.zeros((8, 6, 5)))
    code, _, err = run_cli(["evaluate", pred, other], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem evaluate: error: No case of PRED {str(pred)!r} is in REF {str(other)!r} "
                           "(predictions: 'case_a', 'patient_0001'; references: 'zzz'); expected the same case ids.")


def test_two_files_for_one_case_are_an_error(folders, capsys):
    pred, ref = folders
    _write(pred / "case_a.nii", np.zeros((8, 6, 5)))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert f"Case 'case_a': two files in PRED {str(pred)!r} (case_a.nii, case_a.nii.gz)" in err


def test_shape_mismatch_is_an_error(folders, capsys):
    pred, ref = folders
    _write(pred / "case_a.nii.gz", np.zeros((8, 6, 4)))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert err.startswith("bigmem evaluate: error: Case 'case_a': prediction shape (8, 6, 4) != reference shape "
                          "(8, 6, 5)")
    assert "expected the prediction on the reference's voxel grid." in err
    assert len(err.strip().splitlines()) == 1


def test_nonexistent_folder_is_an_error(folders, tmp_path, capsys):
    pred, _ = folders
    code, _, err = run_cli(["evaluate", pred, tmp_path / "nowhere"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem evaluate: error: REF {str(tmp_path / 'nowhere')!r} is not a folder: expected a "
                           "dataset folder (MSD or nnU-Net v2: labelsTr/, labelsTs/; KiTS case folders: "
                           "case_00000/segmentation.nii.gz), a folder of NIfTI label maps (<case>.nii.gz) or a bigmem "
                           "store (.h5).")
    code, _, err = run_cli(["evaluate", tmp_path / "nopred", pred], capsys)
    assert code == 1
    assert "PRED" in err
    assert "is not a folder" in err


def test_non_integer_labels_are_an_error(folders, capsys):
    pred, ref = folders
    _write(pred / "case_a.nii.gz", np.full((8, 6, 5), 0.5), dtype=np.float32)
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert "Case 'case_a': prediction has non-integer label values (e.g. 0.5)" in err
    assert "expected a label map, not probabilities." in err


def test_integral_float_labels_are_accepted(folders, capsys):
    pred, ref = folders
    _write(pred / "case_a.nii.gz", _box((8, 6, 5), (1, np.s_[1:4])), dtype=np.float32)
    code, _, err = run_cli(["evaluate", pred, ref, "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["metric_per_case"][0]["metrics"]["1"]["TP"] == 90


def test_label_at_or_above_num_classes_is_an_error(folders, capsys):
    pred, ref = folders
    code, _, err = run_cli(["evaluate", pred, ref, "--num-classes", "2"], capsys)
    assert code == 1
    assert err.strip().endswith("Case 'patient_0001': reference label value 2 >= number of classes 2 "
                                f"({ref / 'patient_0001.nii.gz'}); expected values 0..1.")


@pytest.mark.parametrize("flag, message", [
    (["--classes", "a,b"], "Invalid --classes 'a,b': expected comma-separated labels such as 1,2,3."),
    (["--classes", "0,1"], "Invalid --classes [0, 1]: expected foreground labels >= 1"),
    (["--classes", "3", "--num-classes", "3"], "Invalid --classes [3]: label 3 > 2, the largest label"),
])
def test_bad_classes_are_usage_errors(folders, capsys, flag, message):
    pred, ref = folders
    code, _, err = run_cli(["evaluate", pred, ref] + flag, capsys)
    assert code == 2
    assert message in err


def test_affine_difference_is_a_warning(folders, capsys):
    pred, ref = folders
    shifted = np.diag(list(SPACING) + [1.0])
    shifted[0, 3] = 0.5
    _write(pred / "case_a.nii.gz", _box((8, 6, 5), (1, np.s_[1:4])), affine=shifted)
    code, out, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 0, err
    assert "warning: Case 'case_a': prediction affine differs from the reference's" in out
    summary = json.loads((pred / "summary.json").read_text())
    assert len(summary["warnings"]) == 1
    assert "by 0.5" in summary["warnings"][0]


def test_store_reference_uses_source_geometry(tiny_store, tmp_path, capsys, monkeypatch):
    # a stand-in for bigmem.infer.geometry.source_label_from_store: the store's label, spacing 2 mm
    from bigmem.data.store import HDF5VolumeStore

    calls = []

    def source_label_from_store(store, case_id):
        calls.append(case_id)
        return store.read_label(case_id), np.diag([2.0, 2.0, 2.0, 1.0]), (2.0, 2.0, 2.0)

    monkeypatch.setattr("bigmem.infer.geometry.source_label_from_store", source_label_from_store)
    with HDF5VolumeStore(tiny_store) as store:
        case_id = store.case_ids[0]
        label = store.read_label(case_id)
    pred = tmp_path / "pred"
    pred.mkdir()
    _write(pred / f"{case_id}.nii.gz", label, spacing=(2.0, 2.0, 2.0))
    code, out, err = run_cli(["evaluate", pred, tiny_store, "--allow-missing"], capsys)
    assert code == 0, err
    assert calls == [case_id]
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["classes"] == [1, 2]
    assert summary["label_names"] == {"1": "class1", "2": "class2"}
    metrics = summary["metric_per_case"][0]["metrics"]
    for c in (1, 2):
        assert metrics[str(c)]["Dice"] == 1.0
        assert metrics[str(c)]["HD95_mm"] == 0.0
        assert metrics[str(c)]["ref_volume_ml"] == pytest.approx(np.count_nonzero(label == c) * 8 / 1000)
    assert summary["metric_per_case"][0]["reference_file"] == f"{tiny_store}:{case_id}"
    assert len(summary["missing"]["no_prediction"]) == 3
    label[0, 0, 0] = 3  # the store has 3 classes: 0..2
    _write(pred / f"{case_id}.nii.gz", label, spacing=(2.0, 2.0, 2.0))
    code, _, err = run_cli(["evaluate", pred, tiny_store, "--allow-missing"], capsys)
    assert code == 1
    assert f"Case {case_id!r}: prediction label value 3 >= number of classes 3" in err


def test_help_states_the_empty_rule_without_heavy_imports():
    from bigmem.infer.metrics import EMPTY_RULE

    snippet = ("import sys, contextlib, io\nfrom bigmem.cli.main import main\nbuf = io.StringIO()\n"
               "with contextlib.redirect_stdout(buf):\n    code = main(['evaluate', '--help'])\n"
               "print(code, 'nibabel' in sys.modules, 'scipy' in sys.modules)\nprint(buf.getvalue())")
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True)
    first, help_text = result.stdout.split("\n", 1)
    assert first == "0 False False"
    assert " ".join(EMPTY_RULE.split()) in " ".join(help_text.split())
    assert "--allow-missing" in help_text



def test_an_image_given_as_the_reference_is_named_as_one(folders, capsys):
    """A CT in HU where a label map belongs (KiTS19's imaging.nii.gz beside segmentation.nii.gz)."""
    pred, ref = folders
    ct = np.full((8, 6, 5), -1000, np.int16)
    ct[2:5] = 40
    _write(ref / "case_a.nii.gz", ct, dtype=np.int16)
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem evaluate: error: Case 'case_a': reference {ref / 'case_a.nii.gz'} looks like an "
                           "image, not a label map: values -1000..40; expected labels 0..255 (is it the scan, e.g. "
                           "imaging.nii.gz, instead of its segmentation?).")


def test_one_case_in_both_is_one_case(folders, capsys):
    pred, ref = folders
    (pred / "case_a.nii.gz").unlink()
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert err.strip().endswith("Pass --allow-missing to evaluate only the 1 case in both.")
    code, out, err = run_cli(["evaluate", pred, ref, "--allow-missing"], capsys)
    assert code == 0, err
    assert "1 case; means over the cases where defined" in out
    assert "1 cases" not in out


def _named_store(tiny_store, path, regions=None, label_names=("background", "kidney", "tumour")):
    import h5py

    copy_store(tiny_store, path)
    with h5py.File(path, "r+") as handle:
        handle.attrs["label_names"] = list(label_names)
        if regions is not None:
            handle.attrs["regions"] = regions if isinstance(regions, str) else json.dumps(regions)
    return path


def test_store_regions_are_scored_beside_the_classes(tiny_store, tmp_path, capsys):
    from bigmem.data.store import HDF5VolumeStore

    store = _named_store(tiny_store, tmp_path / "named.h5", {"tumour": [1, 2], "core": [2]})
    with HDF5VolumeStore(store) as opened:
        case_id = opened.case_ids[0]
        label = opened.read_label(case_id)
    n1, n2 = int(np.count_nonzero(label == 1)), int(np.count_nonzero(label == 2))
    assert n1
    assert n2
    merged = label.copy()
    merged[merged == 2] = 1  # every class-2 voxel predicted as class 1: the region of both is exact
    pred = tmp_path / "pred"
    pred.mkdir()
    _write(pred / f"{case_id}.nii.gz", merged, spacing=(1.0, 1.0, 1.0))
    code, out, err = run_cli(["evaluate", pred, store, "--allow-missing"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["label_names"] == {"1": "kidney", "2": "tumour"}
    assert summary["regions"] == {"tumour": [1, 2], "core": [2]}
    case = summary["metric_per_case"][0]
    assert case["metrics"]["1"]["Dice"] == pytest.approx(2 * n1 / (2 * n1 + n2))
    assert case["metrics"]["2"]["Dice"] == 0.0
    tumour, core = case["region_metrics"]["tumour"], case["region_metrics"]["core"]
    assert (tumour["Dice"], tumour["HD95_mm"], tumour["TP"], tumour["FP"]) == (1.0, 0.0, n1 + n2, 0)
    assert (core["Dice"], core["FN"], core["HD95_mm"]) == (0.0, n2, None)
    assert summary["region_mean"]["tumour"]["Dice"] == 1.0
    assert summary["region_mean"]["core"]["Dice"] == 0.0
    assert summary["region_foreground_mean"]["Dice"] == 0.5
    assert summary["region_num_undefined"] == {"tumour": {"Dice": 0, "IoU": 0, "HD95_mm": 0},
                                               "core": {"Dice": 0, "IoU": 0, "HD95_mm": 1}}
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 2}
    assert set(rows) >= {"1 kidney", "2 tumour", "foreground mean", "tumour (1,2)", "core (2)", "region mean"}
    assert "1.0000" in rows["tumour (1,2)"]
    assert "0.5000" in rows["region mean"]


@pytest.mark.parametrize("regions, message", [
    ('["tumour"]', "regions must map region names to label values, such as {"),
    ({"tumour": []}, "region 'tumour' is []; expected a list of label values"),
    ({"tumour": [0, 1]}, "region 'tumour' has label values [0]; expected labels 1..2 (background belongs to no "
                         "region)."),
    ({"tumour": [3]}, "region 'tumour' has label values [3]; expected labels 1..2"),
    ("{oops", "regions are not valid JSON"),
])
def test_bad_store_regions_are_one_line(tiny_store, tmp_path, capsys, regions, message):
    store = _named_store(tiny_store, tmp_path / "bad.h5", regions)
    pred = tmp_path / "pred"
    pred.mkdir()
    _write(pred / "synth_0000.nii.gz", np.zeros((16, 16, 16)))
    code, _, err = run_cli(["evaluate", pred, store, "--allow-missing"], capsys)
    assert code == 1
    assert err.startswith(f"bigmem evaluate: error: Store {str(store)!r}: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_dataset_json_beside_the_references_names_classes(folders, capsys):
    pred, ref = folders
    (ref.parent / "dataset.json").write_text(json.dumps(
        {"modality": {"0": "CT"}, "labels": {"0": "background", "1": "kidney", "2": "tumour"}, "training": []}))
    code, out, err = run_cli(["evaluate", pred, ref, "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["label_names"] == {"1": "kidney", "2": "tumour"}
    assert summary["regions"] == {}
    assert "region_mean" not in summary
    assert "region_metrics" not in summary["metric_per_case"][0]
    assert "1 kidney" in out
    assert "region mean" not in out


def test_nnunet_regions_in_dataset_json_are_scored(folders, capsys):
    pred, ref = folders
    (ref.parent / "dataset.json").write_text(json.dumps(
        {"channel_names": {"0": "T1"}, "labels": {"background": 0, "lesion": [1, 2], "core": 2},
         "regions_class_order": [1, 2], "file_ending": ".nii.gz"}))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["regions"] == {"lesion": [1, 2], "core": [2]}
    assert summary["label_names"] == {"1": "lesion", "2": "core"}  # the region regions_class_order paints each with
    cases = {case["case_id"]: case["region_metrics"] for case in summary["metric_per_case"]}
    # case_a: the lesion is class 1 (TP 90, FN 30); patient_0001: class 1's 30 voxels found, class 2's 30 missed
    assert cases["case_a"]["lesion"]["Dice"] == pytest.approx(180 / 210)
    assert cases["case_a"]["lesion"]["HD95_mm"] == pytest.approx(2.0)
    assert cases["case_a"]["core"]["Dice"] is None
    assert (cases["patient_0001"]["lesion"]["TP"], cases["patient_0001"]["lesion"]["FN"]) == (30, 30)
    assert cases["patient_0001"]["lesion"]["Dice"] == pytest.approx(60 / 90)
    assert summary["region_mean"]["lesion"]["Dice"] == pytest.approx((180 / 210 + 60 / 90) / 2)
    assert summary["region_mean"]["core"]["Dice"] == 0.0
    assert summary["region_num_undefined"]["core"]["Dice"] == 1


def test_an_unreadable_dataset_json_is_a_warning(folders, capsys):
    pred, ref = folders
    (ref.parent / "dataset.json").write_text('{"labels": {"background": 0, "lesion": [1, "x"]}}')
    code, out, err = run_cli(["evaluate", pred, ref, "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["label_names"] == {"1": "class1", "2": "class2"}
    assert summary["regions"] == {}
    assert summary["warnings"] == [f"{ref.parent / 'dataset.json'}: label 'lesion' is [1, \"x\"]; expected a label "
                                   "value 0..255 or, for a region, a list of them, such as {\"background\": 0, "
                                   "\"whole_tumor\": [1, 2, 3], \"tumor_core\": [2, 3], \"enhancing_tumor\": 3}. "
                                   "Classes are named class1, class2, ... and no regions are scored."]


def _fake_run(path, store, num_classes=3):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model": {"num_classes": num_classes},
                                                  "data": {"store": str(store)}}))
    return path


def test_run_names_the_classes_and_sets_their_number(folders, tiny_store, tmp_path, capsys):
    import dataclasses

    from bigmem.infer.modelcard import ModelCard

    pred, ref = folders
    store = _named_store(tiny_store, tmp_path / "named.h5")
    run = _fake_run(tmp_path / "run", store)
    code, _, err = run_cli(["evaluate", pred, ref, "--run", run, "--no-hausdorff"], capsys)
    assert code == 0, err  # a run without preprocessing.json: its training store names the classes
    assert json.loads((pred / "summary.json").read_text())["label_names"] == {"1": "kidney", "2": "tumour"}
    # a run's preprocessing.json names them (and its regions) even once the store is gone
    dataclasses.replace(ModelCard.from_store(store), regions={"both": [1, 2]}).write(run)
    store.unlink()
    code, out, err = run_cli(["evaluate", pred, ref, "--run", run, "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["label_names"] == {"1": "kidney", "2": "tumour"}
    assert summary["regions"] == {"both": [1, 2]}
    assert summary["region_mean"]["both"]["Dice"] == pytest.approx((180 / 210 + 60 / 90) / 2)
    assert "2 tumour" in out
    assert "both (1,2)" in out
    code, _, err = run_cli(["evaluate", pred, ref, "--run", run, "--num-classes", "4"], capsys)
    assert (code, err.strip()) == (2, f"bigmem evaluate: error: Invalid --num-classes 4: run {str(run)!r} has 3 "
                                      "classes; drop --num-classes.")
    small = _fake_run(tmp_path / "small", store, num_classes=2)  # its model has no class 2
    code, _, err = run_cli(["evaluate", pred, ref, "--run", small], capsys)
    assert code == 1
    assert "reference label value 2 >= number of classes 2" in err


def test_a_run_whose_store_is_gone_leaves_classes_unnamed(folders, tmp_path, capsys):
    pred, ref = folders
    run = _fake_run(tmp_path / "run", tmp_path / "gone.h5")
    code, out, err = run_cli(["evaluate", pred, ref, "--run", run, "--no-hausdorff"], capsys)
    assert code == 0, err
    summary = json.loads((pred / "summary.json").read_text())
    assert summary["label_names"] == {"1": "class1", "2": "class2"}
    assert summary["warnings"] == [f"Run {str(run)!r} has no preprocessing.json and its training store "
                                   f"{str(tmp_path / 'gone.h5')!r} is gone: nothing names its classes; they are "
                                   "class1, class2, ..."]
    code, _, err = run_cli(["evaluate", pred, ref, "--run", tmp_path / "nowhere"], capsys)
    assert code == 1
    assert "is not a bigmem run directory: no config.json there." in err


def test_a_ref_dataset_json_of_neither_layout_is_named(folders, tmp_path, capsys):
    pred, _ = folders
    ref = tmp_path / "Task05"
    ref.mkdir()
    (ref / "dataset.json").write_text(json.dumps({"modality": {"0": "CT"}, "labels": {"0": "background", "1": "a"}}))
    code, _, err = run_cli(["evaluate", pred, ref], capsys)
    assert code == 1
    assert err.startswith(f"bigmem evaluate: error: {ref / 'dataset.json'} lists no training cases and has no "
                          "channel_names")
    assert len(err.strip().splitlines()) == 1
