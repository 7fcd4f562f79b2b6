"""A run directory is a model: predict needs nothing else (no training store), and ``bigmem export`` copies it."""

from __future__ import annotations

import json
import shutil

import h5py
import nibabel as nib
import numpy as np
import pytest

from bigmem.data.convert import convert
from bigmem.data.nifti import SourceCase, SourceDataset
from helpers import run_cli

AFFINE = np.diag([0.8, 0.8, 2.5, 1.0])


def _ct_dataset(root, rng):
    """Three int16 'CT' cases in HU: air at -1000, tissue near 40, a brighter organ and lesion."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    cases = []
    for index, shape in enumerate([(18, 14, 11), (15, 17, 9), (16, 16, 12)]):
        label = np.zeros(shape, np.uint8)
        label[3:12, 3:11, 2:8] = 1
        label[5:8, 5:8, 3:6] = 2
        image = np.full(shape, -1000.0)
        image[1:-1, 1:-1, 1:-1] = 40 + rng.normal(0, 20, (shape[0] - 2, shape[1] - 2, shape[2] - 2))
        image[label == 1] = 150 + rng.normal(0, 20, int((label == 1).sum()))
        image[label == 2] = 260 + rng.normal(0, 20, int((label == 2).sum()))
        image_path, label_path = root / "imagesTr" / f"ct_{index}.nii.gz", root / "labelsTr" / f"ct_{index}.nii.gz"
        nib.save(nib.Nifti1Image(np.round(image).astype(np.int16), AFFINE), str(image_path))
        nib.save(nib.Nifti1Image(label, AFFINE), str(label_path))
        cases.append(SourceCase(f"ct_{index}", image_path, label_path))
    return SourceDataset(cases, ["CT"], ["background", "organ", "lesion"], str(root))


@pytest.fixture(scope="module")
def ct_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    dataset = _ct_dataset(root / "src", np.random.default_rng(0))
    store = root / "ct.h5"
    convert(dataset, store)
    run = root / "run"
    from bigmem.cli.main import main

    assert main(["train", "--model", "tiny", "--data", str(store), "--steps", "2", "--out", str(run)]) == 0
    return root, store, run


def test_ct_store_is_int16_with_the_foreground_window(ct_run):
    root, store, _ = ct_run
    with h5py.File(store) as handle:
        assert {handle[f"cases/{c}/image"].dtype for c in handle["cases"]} == {np.dtype(np.int16)}
        scheme = json.loads(handle.attrs["preprocessing"])["channels"][0]
        samples = np.concatenate([handle[f"cases/{c}/foreground"][...] for c in handle["cases"]])
    assert scheme["scheme"] == "ct"
    # nnU-Net's CT scheme: the foreground's 0.5/99.5 percentiles, mean and std, pooled over the cases
    assert (scheme["low"], scheme["high"]) == pytest.approx(tuple(np.percentile(samples[:, 0], (0.5, 99.5))))
    assert scheme["mean"] == pytest.approx(float(samples.mean()))
    assert 150 < scheme["mean"] < 200
    assert -1000 < scheme["low"] < 150
    assert scheme["high"] > 250  # air is clipped away, not in the window


def test_the_run_directory_predicts_on_its_own_and_export_carries_it(ct_run, tmp_path, capsys):
    root, store, run = ct_run
    card = json.loads((run / "preprocessing.json").read_text())
    assert card["channel_names"] == ["CT"]
    assert card["label_names"] == ["background", "organ", "lesion"]
    assert card["preprocessing"]["channels"][0]["scheme"] == "ct"
    assert card["spacing"] is None
    scan = root / "src" / "imagesTr" / "ct_1.nii.gz"
    assert run_cli(["predict", run, scan, "-o", tmp_path / "before", "--mode", "whole"], capsys)[0] == 0
    code, stdout, err = run_cli(["export", run, "-o", tmp_path / "model"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "config.json", "model.keras", "plan.json", "preprocessing.json"]
    assert f"Exported {run} to {tmp_path / 'model'}" in stdout
    moved = tmp_path / "elsewhere" / "model"  # another machine: the store and the run are gone
    shutil.copytree(tmp_path / "model", moved)
    shutil.rmtree(tmp_path / "model")
    store_copy = tmp_path / "ct.h5"
    shutil.move(store, store_copy)
    try:
        code, _, err = run_cli(["predict", moved, scan, "-o", tmp_path / "after", "--mode", "whole"], capsys)
        assert code == 0, err
        before = np.asanyarray(nib.load(str(tmp_path / "before" / "ct_1.nii.gz")).dataobj)
        after = nib.load(str(tmp_path / "after" / "ct_1.nii.gz"))
        assert np.array_equal(np.asanyarray(after.dataobj), before)
        assert after.shape == (15, 17, 9)
        np.testing.assert_allclose(after.affine, AFFINE)
        # the run itself, too, predicts without its store
        assert run_cli(["predict", run, scan, "-o", tmp_path / "run_only", "--mode", "whole"], capsys)[0] == 0
    finally:
        shutil.move(store_copy, store)


def test_export_refuses_what_it_cannot_do(ct_run, tmp_path, capsys):
    _, _, run = ct_run
    (tmp_path / "taken").mkdir()
    code, _, err = run_cli(["export", run, "-o", tmp_path / "taken"], capsys)
    assert (code, err.strip()) == (1, f"bigmem export: error: '{tmp_path / 'taken'}' exists: pass --force to replace "
                                      "it, or choose another -o.")
    code, _, err = run_cli(["export", run, "-o", run / "inside"], capsys)
    assert code == 1
    assert "is inside the run directory" in err
    code, _, err = run_cli(["export", tmp_path, "-o", tmp_path / "m"], capsys)
    assert (code, err.strip()) == (1, f"bigmem export: error: '{tmp_path}' is not a bigmem run directory: no "
                                      "config.json there.")
    code, _, err = run_cli(["export", run, "-o", tmp_path / "m", "--checkpoint", "best"], capsys)
    assert code == 1
    assert "No checkpoint 'best'" in err
    assert not (tmp_path / "m").exists()
