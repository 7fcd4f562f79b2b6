"""Every dataset layout end to end: convert -> train -> predict -> evaluate, with the dataset folder as REF.

``bigmem evaluate`` reads REF through ``bigmem.data.layouts.list_labels``, the reader ``convert`` and
``predict`` use, so the case ids ``predict`` writes are the ones the references are found under.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import make_kits, run_cli, save_nifti

SHAPES = [(12, 16, 12), (14, 12, 13), (13, 14, 12)]  # odd sizes: padded to the tiny network's multiple of 4
LABELS = {"0": "background", "1": "lesion", "2": "core"}


def _case(shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A scan brighter where its label (0, 1, 2 in blocks) is."""
    rng = np.random.default_rng(seed)
    label = np.zeros(shape, np.uint8)
    label[2:7, 3:9, 2:6] = 1
    label[4:6, 5:7, 3:5] = 2
    return (rng.normal(0, 1, shape) + 2.0 * label).astype(np.float32), label


def _msd(root: Path):
    training = []
    for i, shape in enumerate(SHAPES):
        image, label = _case(shape, i)
        save_nifti(root / "imagesTr" / f"la_00{i}.nii.gz", image)
        save_nifti(root / "labelsTr" / f"la_00{i}.nii.gz", label)
        training.append({"image": f"./imagesTr/la_00{i}.nii.gz", "label": f"./labelsTr/la_00{i}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"modality": {"0": "MRI"}, "labels": LABELS,
                                                   "training": training}))
    return [root], [[root]], root, ["la_000", "la_001", "la_002"], []


def _nnunet(root: Path):
    """Two training cases and a test case with its label in labelsTs/: predict segments imagesTs/, then imagesTr/."""
    for i, (shape, folder) in enumerate(zip(SHAPES, ("Tr", "Tr", "Ts"))):
        image, label = _case(shape, i)
        save_nifti(root / f"images{folder}" / f"BraTS_{i:03d}_0000.nii.gz", image)
        save_nifti(root / f"labels{folder}" / f"BraTS_{i:03d}.nii.gz", label)
    (root / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "T1"}, "labels": {name: int(value) for value, name in LABELS.items()},
        "numTraining": 2, "file_ending": ".nii.gz"}))
    return [root], [[root], [root / "imagesTr"]], root, ["BraTS_000", "BraTS_001", "BraTS_002"], []


def _kits(root: Path):
    """Two segmented cases and a test case: its prediction has no reference."""
    make_kits(root, {"case_00000": (SHAPES[0], (0, 1, 2)), "case_00001": (SHAPES[1], (0, 1)),
                     "case_00002": (SHAPES[2], None)})
    return [root], [[root]], root, ["case_00000", "case_00001"], ["--allow-missing"]


def _flat(root: Path):
    """Loose files: images/CASE_0000.nii.gz and labels/CASE.nii.gz, converted from globs."""
    for i, shape in enumerate(SHAPES):
        image, label = _case(shape, i)
        save_nifti(root / "images" / f"p{i}_0000.nii.gz", image)
        save_nifti(root / "labels" / f"p{i}.nii.gz", label)
    src = ["--images", f"{root}/images/*.nii.gz", "--labels", f"{root}/labels/*.nii.gz"]
    return src, [[root / "images"]], root / "labels", ["p0", "p1", "p2"], []


@pytest.mark.slow
@pytest.mark.parametrize("layout", [_msd, _nnunet, _kits, _flat], ids=["msd", "nnunet", "kits", "flat"])
def test_each_layout_converts_trains_predicts_and_evaluates(tmp_path, capsys, layout):
    src, inputs, ref, case_ids, evaluate_flags = layout(tmp_path / "data")
    store, run, out = tmp_path / "store.h5", tmp_path / "run", tmp_path / "predictions"
    code, _, err = run_cli(["convert", *src, "-o", store], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", "--model", "tiny", "--data", store, "--steps", 1, "--augment", "none",
                            "--monitor-interval", 0, "--out", run], capsys)
    assert code == 0, err
    for source in inputs:
        code, _, err = run_cli(["predict", run, *source, "-o", out], capsys)
        assert code == 0, err
    code, _, err = run_cli(["evaluate", out, ref, "--no-hausdorff", *evaluate_flags], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert [row["case_id"] for row in summary["metric_per_case"]] == case_ids
    assert summary["missing"]["no_prediction"] == []
    assert summary["missing"]["no_reference"] == (["case_00002"] if layout is _kits else [])
    assert summary["label_names"] == NAMES[layout]  # from the dataset's own dataset.json, or KiTS's classes


NAMES = {_msd: {"1": "lesion", "2": "core"}, _nnunet: {"1": "lesion", "2": "core"},
         _kits: {"1": "kidney", "2": "tumor"}, _flat: {"1": "class1", "2": "class2"}}
