"""bigmem predict: a trained tiny run segments stores and NIfTI files in their source geometry."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from bigmem.data.convert import convert
from bigmem.data.nifti import SourceCase, SourceDataset
from bigmem.infer.evaluate import evaluate
from helpers import run_cli

# Voxel axes point along world (-y, z, -x): the source grid is a permutation and flip of the store's.
PERMUTED_LPS = np.array([[0.0, 0.0, -2.0, 90.0], [-1.5, 0.0, 0.0, 120.0], [0.0, 1.2, 0.0, -60.0], [0, 0, 0, 1]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run on the tiny phantoms (4 cases, the last held out), validated at its last step."""
    import io
    import sys

    from bigmem.cli.main import main
    from bigmem.data.synth import write_synthetic_store

    root = tmp_path_factory.mktemp("predict")
    store = write_synthetic_store(root / "tiny.h5", num_cases=4, volume=16, num_classes=3, seed=0)
    run = root / "run"
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        code = main(["train", "--model", "tiny", "--data", str(store), "--steps", "4", "--holdout", "1",
                     "--val-every", "2", "--lr", "1e-2", "--checkpoint-every", "2", "--out", str(run)])
    finally:
        sys.stdout = out
    assert code == 0
    return run, store


def _labels(path):
    image = nib.load(str(path))
    return np.asanyarray(image.dataobj), image.affine


def test_held_out_dice_from_predict_and_evaluate_equals_val_dice(trained, tmp_path, capsys):
    run, store = trained
    code, stdout, err = run_cli(["predict", run, store, "--cases", "synth_0003", "-o", tmp_path / "pred",
                                 "--mode", "whole", "--ignore-plan"], capsys)
    assert code == 0, err
    assert stdout.startswith("synth_0003: whole, 16x16x16, ")
    assert "Segmented 1 case into" in stdout
    labels, affine = _labels(tmp_path / "pred" / "synth_0003.nii.gz")
    assert labels.dtype == np.uint8
    assert labels.shape == (16, 16, 16)
    assert set(np.unique(labels)) <= {0, 1, 2}
    summary = evaluate(tmp_path / "pred", store, allow_missing=True)
    val = json.loads((run / "summary.json").read_text())
    assert summary["foreground_mean_defined"]["Dice"] == pytest.approx(val["val_dice"], abs=1e-12)
    for label, dice in val["val_dice_per_class"].items():
        assert summary["mean"][label]["Dice"] == pytest.approx(dice, abs=1e-12)
    assert not [p for p in (tmp_path / "pred").iterdir() if p.name.startswith(".")]  # no temporaries


def test_one_window_over_the_whole_volume_is_the_whole_pass(trained, tmp_path, capsys):
    """Sliding with the window = the volume is one window: its Gaussian weights cancel exactly."""
    run, store = trained
    whole = ["predict", run, store, "--cases", "synth_0000", "--save-probabilities"]
    assert run_cli([*whole, "-o", tmp_path / "w", "--mode", "whole", "--ignore-plan"], capsys)[0] == 0
    assert run_cli([*whole, "-o", tmp_path / "s", "--mode", "sliding", "--window", "16"], capsys)[0] == 0
    assert run_cli([*whole, "-o", tmp_path / "d", "--mode", "sliding", "--window", "16,16,16"], capsys)[0] == 0
    a = np.load(tmp_path / "w" / "synth_0000_probabilities.npz")
    b = np.load(tmp_path / "s" / "synth_0000_probabilities.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "d" / "synth_0000_probabilities.npz")["probabilities"],
                                  b["probabilities"])  # --window N is --window N,N,N
    assert a["probabilities"].dtype == np.float16
    assert a["probabilities"].shape == (16, 16, 16, 3)
    np.testing.assert_allclose(a["probabilities"].astype(np.float32), b["probabilities"].astype(np.float32),
                               atol=2e-3)
    np.testing.assert_allclose(a["probabilities"].astype(np.float32).sum(-1), 1.0, atol=5e-3)
    labels, _ = _labels(tmp_path / "w" / "synth_0000.nii.gz")  # the argmax of the float32 probabilities
    ranked = np.sort(a["probabilities"].astype(np.float32), -1)
    clear = ranked[..., -1] - ranked[..., -2] > 2e-3  # float16 can tie where the top two are close
    np.testing.assert_array_equal(np.argmax(a["probabilities"], -1)[clear], labels[clear])
    assert clear.mean() > 0.95


def test_sliding_with_tta_over_a_smaller_window(trained, tmp_path, capsys):
    run, store = trained
    # two of the four cases: 8 windows (two a side, overlapping by 8 of their 12 voxels) x 8 flips each
    # (a window of 8 at this overlap is 27 windows: more of the same, at over three times the cost)
    code, stdout, err = run_cli(["predict", run, store, "-o", tmp_path / "s", "--mode", "sliding", "--window", "12",
                                 "--overlap", "0.5", "--tta", "--accumulate", "float16",
                                 "--cases", "synth_0000,synth_0002"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["synth_0000.nii.gz", "synth_0002.nii.gz"]
    assert stdout.count(": sliding +tta, 16x16x16, ") == 2


def test_checkpoints_by_name(trained, tmp_path, capsys):
    run, store = trained
    for name in ("best", "latest", "ckpt-2", "4"):
        code, _, err = run_cli(["predict", run, store, "--cases", "synth_0001", "-o", tmp_path / name,
                                "--mode", "sliding", "--checkpoint", name], capsys)
        assert code == 0, (name, err)
    latest, _ = _labels(tmp_path / "latest" / "synth_0001.nii.gz")
    four, _ = _labels(tmp_path / "4" / "synth_0001.nii.gz")
    np.testing.assert_array_equal(latest, four)
    code, _, err = run_cli(["predict", run, store, "-o", tmp_path / "x", "--checkpoint", "ckpt-3"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem predict: error: No checkpoint 'ckpt-3' in {run / 'checkpoints'}: expected latest "
                           "or one of ckpt-00000002, ckpt-00000004, best.")


def test_nifti_input_comes_back_in_its_own_geometry(tmp_path, capsys):
    """Trained on a converted store with a permuted LPS affine, crop and pad; a NIfTI file is segmented on its grid."""
    rng = np.random.default_rng(0)
    source = tmp_path / "src"
    (source / "imagesTr").mkdir(parents=True)
    (source / "labelsTr").mkdir()
    cases = []
    for index, shape in enumerate([(19, 14, 13), (17, 15, 12)]):
        label = np.zeros(shape, np.uint8)
        label[4:12, 3:10, 3:9] = 1
        label[6:9, 5:8, 4:7] = 2
        image = (rng.normal(0, 1, shape) + 3 * label).astype(np.float32)
        image_path, label_path = source / "imagesTr" / f"c{index}.nii.gz", source / "labelsTr" / f"c{index}.nii.gz"
        nib.save(nib.Nifti1Image(image, PERMUTED_LPS), str(image_path))
        nib.save(nib.Nifti1Image(label, PERMUTED_LPS), str(label_path))
        cases.append(SourceCase(f"c{index}", image_path, label_path))
    store = tmp_path / "store.h5"
    convert(SourceDataset(cases, ["image"], ["background", "a", "b"], str(source)), store, shape=(16, 16, 16))
    run = tmp_path / "run"
    assert run_cli(["train", "--model", "tiny", "--data", store, "--steps", 2, "--volume", 16, "--out", run],
                   capsys)[0] == 0
    code, stdout, err = run_cli(["predict", run, source / "imagesTr" / "c0.nii.gz", "-o", tmp_path / "out",
                                 "--mode", "sliding"], capsys)
    assert code == 0, err
    labels, affine = _labels(tmp_path / "out" / "c0.nii.gz")
    assert labels.shape == (19, 14, 13)
    assert labels.dtype == np.uint8
    np.testing.assert_allclose(affine, PERMUTED_LPS, atol=1e-6)
    code, _, err = run_cli(["predict", run, source / "imagesTr", "-o", tmp_path / "all", "--mode", "sliding"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["c0.nii.gz", "c1.nii.gz"]
    assert _labels(tmp_path / "all" / "c1.nii.gz")[0].shape == (17, 15, 12)


@pytest.mark.parametrize("argv, code, message", [
    (["predict", "{tmp}/nothing", "{store}", "-o", "{tmp}/o"], 1,
     "bigmem predict: error: '{tmp}/nothing' is not a bigmem run directory: no config.json there."),
    (["predict", "{run}", "{tmp}/missing.nii.gz", "-o", "{tmp}/o", "--mode", "sliding"], 1,
     "bigmem predict: error: Cannot read INPUT '{tmp}/missing.nii.gz': no such file or folder."),
    (["predict", "{run}", "{store}", "-o", "{tmp}/o", "--cases", "nope", "--mode", "sliding"], 1,
     "bigmem predict: error: --cases: 'nope' not in '{store}' (it has 4 cases, e.g. synth_0000, synth_0001, "
     "synth_0002)."),
    (["predict", "{run}", "{store}", "-o", "{tmp}/o", "--overlap", "1"], 2,
     "bigmem predict: error: Invalid --overlap 1: expected a fraction in [0, 1)."),
    (["predict", "{run}", "{store}", "-o", "{tmp}/o", "--mode", "sliding", "--window", "6"], 2,
     "bigmem predict: error: Invalid --window 6: expected a positive multiple of 4 (the network downsamples 2 "
     "times)."),
    (["predict", "{run}", "{store}", "-o", "{tmp}/o", "--mode", "sliding", "--window", "8,6,8"], 2,
     "bigmem predict: error: Invalid --window 8,6,8: axis 2 (6) is not a multiple of 4 (the network downsamples 2 "
     "times). Try --window 8,4,8 or 8,8,8."),
    (["predict", "{run}", "{store}", "-o", "{tmp}/o", "--window", "8,8"], 2,
     "bigmem predict: error: Invalid --window '8,8': expected three positive integers D,H,W such as 240,240,144."),
])
def test_bad_input_is_one_line(trained, tmp_path, capsys, argv, code, message):
    run, store = trained
    fill = {"tmp": str(tmp_path), "store": str(store), "run": str(run)}
    got, _, err = run_cli([a.format(**fill) for a in argv], capsys)
    assert (got, err.strip()) == (code, message.format(**fill))


@pytest.fixture(scope="module")
def kits_run(tmp_path_factory):
    """A tiny run trained on two KiTS case folders (converted to 16^3), and the folders with a third, test case."""
    import io
    import sys

    from bigmem.cli.main import main
    from bigmem.data.layouts import read_dataset
    from helpers import make_kits

    root = tmp_path_factory.mktemp("kits")
    kits = make_kits(root / "kits", {"case_00000": ((20, 24, 16), (0, 1, 2)), "case_00001": ((18, 22, 14), (0, 1)),
                                     "case_00002": ((17, 20, 15), None)})
    store = root / "kits.h5"
    convert(read_dataset(kits), store, shape=(16, 16, 16))
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        code = main(["train", "--model", "tiny", "--data", str(store), "--steps", "2", "--volume", "16",
                     "--out", str(root / "run")])
    finally:
        sys.stdout = out
    assert code == 0
    return root / "run", kits


def test_kits_folders_predict_into_one_folder_named_by_case(kits_run, tmp_path, capsys):
    run, kits = kits_run
    out = tmp_path / "out"
    code, stdout, err = run_cli(["predict", run, kits, "-o", out, "--mode", "sliding"], capsys)
    assert code == 0, err
    assert stdout.splitlines()[0] == f"KiTS case folders: 3 cases in {kits}"
    assert sorted(p.name for p in out.iterdir()) == ["case_00000.nii.gz", "case_00001.nii.gz", "case_00002.nii.gz"]
    for case_id, shape in (("case_00000", (20, 24, 16)), ("case_00001", (18, 22, 14)), ("case_00002", (17, 20, 15))):
        labels, affine = _labels(out / f"{case_id}.nii.gz")
        assert labels.shape == shape
        assert labels.dtype == np.uint8
        np.testing.assert_allclose(affine, nib.load(str(kits / case_id / "imaging.nii.gz")).affine)
    assert stdout.splitlines()[-1] == f"Segmented 3 cases into {out}."
    first = {p.name: p.read_bytes() for p in out.iterdir()}

    # a second run keeps what is there, and says so; a case of its own folder is named after the folder
    nib.save(nib.Nifti1Image(np.zeros((20, 24, 16), np.uint8), np.eye(4)), str(out / "case_00000.nii.gz"))
    stale = (out / "case_00000.nii.gz").read_bytes()
    code, stdout, err = run_cli(["predict", run, kits, "-o", out, "--mode", "sliding"], capsys)
    assert code == 0, err
    assert stdout.splitlines()[1:] == [
        f"case_0000{i}: {out / f'case_0000{i}.nii.gz'} exists, kept (--force overwrites it)" for i in range(3)] + [
        f"Segmented 0 cases into {out}; kept 3 existing outputs (--force overwrites them)."]
    assert (out / "case_00000.nii.gz").read_bytes() == stale

    # --force segments again and overwrites
    code, stdout, err = run_cli(["predict", run, kits / "case_00000", "-o", out, "--mode", "sliding", "--force"],
                                capsys)
    assert code == 0, err
    assert stdout.splitlines()[0] == f"KiTS case folder: 1 case in {kits / 'case_00000'}"
    assert stdout.splitlines()[-1] == f"Segmented 1 case into {out}."
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_two_inputs_for_one_output_are_refused_before_writing(kits_run, tmp_path, capsys):
    run, kits = kits_run
    scans = tmp_path / "scans"
    scans.mkdir()
    image = kits / "case_00001" / "imaging.nii.gz"
    (scans / "a.nii.gz").write_bytes(image.read_bytes())
    (scans / "a_0000.nii.gz").write_bytes(image.read_bytes())
    (scans / "b.nii.gz").write_bytes(image.read_bytes())
    code, _, err = run_cli(["predict", run, scans, "-o", tmp_path / "out", "--mode", "sliding"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem predict: error: Case 'a': {scans / 'a.nii.gz'} and {scans / 'a_0000.nii.gz'} "
                           "would both be segmented into a.nii.gz; rename one of them, or predict them into different "
                           "folders.")
    assert not (tmp_path / "out").exists()
