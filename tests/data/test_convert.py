"""bigmem convert: MSD/glob sources -> store; exact round trip against nibabel; bad inputs."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import h5py
import nibabel as nib
import numpy as np
import pytest

from bigmem.data.store import HDF5VolumeStore
from helpers import run_cli

# A non-canonical (LPS-like, axis-permuted) affine: canonical reorientation must flip and permute.
PERMUTED_LPS = np.array([[0.0, 0.0, -2.0, 90.0], [-1.5, 0.0, 0.0, 120.0], [0.0, 1.2, 0.0, -60.0], [0, 0, 0, 1]])
PLAIN = np.diag([0.8, 0.9, 1.1, 1.0])


def _save(path: Path, data: np.ndarray, affine: np.ndarray) -> Path:
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def make_msd(root: Path, cases: dict, *, channels=("FLAIR",), labels=("background", "edema", "tumour"),
             nnunet_style: bool = False) -> Path:
    """cases: {case_id: (image array (3D or 4D), label array, affine)}."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for case_id, (image, label, affine) in cases.items():
        _save(root / "imagesTr" / f"{case_id}.nii.gz", image, affine)
        _save(root / "labelsTr" / f"{case_id}.nii.gz", label, affine)
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    if nnunet_style:
        meta = {"channel_names": {str(i): c for i, c in enumerate(channels)},
                "labels": {name: i for i, name in enumerate(labels)}}
    else:
        meta = {"modality": {str(i): c for i, c in enumerate(channels)},
                "labels": {str(i): name for i, name in enumerate(labels)}}
    meta.update(numTraining=len(training), training=training)
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _case(shape, rng, channels=1, dtype=np.float32, affine=PERMUTED_LPS):
    image = rng.normal(100, 20, shape + ((channels,) if channels > 1 else ())).astype(dtype)
    label = rng.integers(0, 3, shape).astype(np.uint8)
    return image, label, affine


@pytest.fixture
def msd_3d(tmp_path):
    rng = np.random.default_rng(0)
    return make_msd(tmp_path / "Task09", {"c_033": _case((33, 35, 37), rng), "c_034": _case((34, 36, 33), rng),
                                          "c_int": _case((35, 33, 34), rng, dtype=np.int16, affine=PLAIN)})


def _canonical(path: Path) -> np.ndarray:
    return np.asanyarray(nib.as_closest_canonical(nib.load(str(path))).dataobj)


def test_round_trip_matches_nibabel_canonical(msd_3d, tmp_path, capsys):
    out = tmp_path / "s.h5"
    code, stdout, err = run_cli(["convert", msd_3d, "-o", out], capsys)
    assert code == 0, err
    assert f"Wrote 3 cases to {out}" in stdout
    with h5py.File(out) as handle:
        assert handle.attrs["num_classes"] == 3
        assert list(handle.attrs["channel_names"]) == ["FLAIR"]
        assert list(handle.attrs["label_names"]) == ["background", "edema", "tumour"]
        for case_id in ("c_033", "c_034", "c_int"):
            group = handle[f"cases/{case_id}"]
            src_image = msd_3d / "imagesTr" / f"{case_id}.nii.gz"
            expected = _canonical(src_image)
            if case_id == "c_int":  # an integer source is stored as int16, exactly
                assert group["image"].dtype == np.int16
                np.testing.assert_array_equal(group["image"][..., 0], expected)
            else:  # a float source as float16, each voxel within 1% of the channel's spread
                assert group["image"].dtype == np.float16
                np.testing.assert_allclose(group["image"][..., 0], expected, rtol=0, atol=0.01 * expected.std())
            np.testing.assert_array_equal(group["label"][...], _canonical(msd_3d / "labelsTr" / f"{case_id}.nii.gz"))
            canonical = nib.as_closest_canonical(nib.load(str(src_image)))
            np.testing.assert_allclose(group.attrs["affine"], canonical.affine)
            np.testing.assert_allclose(group.attrs["source_affine"], nib.load(str(src_image)).affine)
            np.testing.assert_allclose(group.attrs["spacing"], canonical.header.get_zooms()[:3])
            assert list(group.attrs["source_shape"]) == list(nib.load(str(src_image)).shape)
            assert group.attrs["source_image"] == str(src_image)
    # The permuted LPS affine really was reoriented: voxel axes (0, 1, 2) point along world (y, z, x),
    # so RAS order takes source axes (2, 0, 1).
    assert HDF5VolumeStore(out).cases[0].shape == (37, 33, 35)


def test_manifest(msd_3d, tmp_path, capsys):
    out = tmp_path / "s.h5"
    assert run_cli(["convert", msd_3d, "-o", out], capsys)[0] == 0
    manifest = json.loads((tmp_path / "s.manifest.json").read_text())
    assert manifest["num_classes"] == 3
    assert sorted(manifest["cases"]) == ["c_033", "c_034", "c_int"]
    entry = manifest["cases"]["c_033"]
    image = _canonical(msd_3d / "imagesTr" / "c_033.nii.gz").astype(np.float64)
    assert entry["shape"] == [37, 33, 35, 1]
    assert entry["source_shape"] == [33, 35, 37]
    assert entry["spacing"] == pytest.approx([2.0, 1.5, 1.2])
    assert entry["image_dtype"] == "float16"
    assert entry["label_dtype"] == "uint8"
    assert manifest["cases"]["c_int"]["image_dtype"] == "int16"
    assert entry["label_values"] == [0, 1, 2]
    assert entry["intensity_stats"]["mean"][0] == pytest.approx(image.mean())
    assert entry["intensity_stats"]["std"][0] == pytest.approx(image.std())
    assert entry["intensity_stats"]["min"][0] == pytest.approx(image.min())
    assert entry["intensity_stats"]["nonzero_mean"][0] == pytest.approx(image[image != 0].mean())
    assert manifest["preprocessing"] == {"channels": [{"scheme": "zscore", "low": None, "high": None, "mean": None,
                                                       "std": None}]}  # FLAIR: MRI, no zero background
    digest = hashlib.sha256((msd_3d / "imagesTr" / "c_033.nii.gz").read_bytes()).hexdigest()
    assert entry["source_sha256"]["image"] == digest
    with h5py.File(out, "r") as handle:  # what training checks before its first step, without reading voxels
        for case_id, case in manifest["cases"].items():
            attrs = handle["cases"][case_id].attrs
            assert (int(attrs["label_max"]), int(attrs["nonfinite_voxels"])) == (max(case["label_values"]), 0)


def test_4d_images_and_nnunet_style_json(tmp_path, capsys):
    rng = np.random.default_rng(1)
    src = make_msd(tmp_path / "brats", {"b1": _case((17, 19, 21), rng, channels=4),
                                        "b2": _case((18, 17, 16), rng, channels=4)},
                   channels=("FLAIR", "T1w", "t1gd", "T2w"), labels=("background", "a", "b"), nnunet_style=True)
    out = tmp_path / "b.h5"
    code, _, err = run_cli(["convert", src / "dataset.json", "-o", out, "--volume", 16], capsys)
    assert code == 0, err
    store = HDF5VolumeStore(out)
    assert store.channel_names == ["FLAIR", "T1w", "t1gd", "T2w"]
    assert store.num_channels == 4
    image, label = store.read_case("b1")
    assert image.shape == (16, 16, 16, 4)
    assert label.shape == (16, 16, 16)
    # centre crop of the canonical data (no padding needed on axes >= 16)
    expected = _canonical(src / "imagesTr" / "b1.nii.gz").astype(np.float32)
    with h5py.File(out) as handle:
        crop_pad = handle["cases/b1"].attrs["crop_pad"]
    d, h, w = (int(c[0]) for c in crop_pad)
    stored = store.cases[0].image_dtype  # float16: the float source rounded, nothing else changed
    np.testing.assert_array_equal(image, expected[d:d + 16, h:h + 16, w:w + 16].astype(stored).astype(np.float32))


def _nnunet(root: Path, rng, cases=("BraTS_001", "BraTS_002"), channels=("FLAIR", "T1w", "T1gd")) -> Path:
    """An nnU-Net v2 raw folder: one file per channel (imagesTr/CASE_000c.nii.gz), no case list in dataset.json."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    for case_id in cases:
        image, label, affine = _case((13, 11, 9), rng, channels=len(channels))
        for c in range(len(channels)):
            _save(root / "imagesTr" / f"{case_id}_{c:04d}.nii.gz", np.round(image[..., c]).astype(np.int16), affine)
        _save(root / "labelsTr" / f"{case_id}.nii.gz", label, affine)
    (root / "dataset.json").write_text(json.dumps({
        "channel_names": {str(i): c for i, c in enumerate(channels)}, "labels": {"background": 0, "a": 1, "b": 2},
        "numTraining": len(cases), "file_ending": ".nii.gz"}))
    return root


def test_nnunet_v2_converts_every_channel_in_order(tmp_path, capsys):
    src = _nnunet(tmp_path / "Dataset001_BrainTumour", np.random.default_rng(6))
    out = tmp_path / "n.h5"
    code, stdout, err = run_cli(["convert", src, "-o", out], capsys)
    assert code == 0, err
    assert stdout.splitlines()[0] == ("nnU-Net v2 raw: 3 channels (FLAIR, T1w, T1gd), 3 classes (background, a, b), "
                                      "2 training cases")
    store = HDF5VolumeStore(out)
    assert store.case_ids == ["BraTS_001", "BraTS_002"]
    assert store.channel_names == ["FLAIR", "T1w", "T1gd"]
    image, label = store.read_case("BraTS_002")
    files = [src / "imagesTr" / f"BraTS_002_{c:04d}.nii.gz" for c in range(3)]
    for c, path in enumerate(files):  # each channel is its own file's canonical data, exactly (int16 is kept)
        np.testing.assert_array_equal(image[..., c], _canonical(path).astype(np.float32))
    np.testing.assert_array_equal(label, _canonical(src / "labelsTr" / "BraTS_002.nii.gz"))
    with h5py.File(out) as handle:
        assert [str(p) for p in handle["cases/BraTS_002"].attrs["source_image"]] == [str(f) for f in files]
    entry = json.loads((tmp_path / "n.manifest.json").read_text())["cases"]["BraTS_002"]
    assert entry["source_image"] == [str(f) for f in files]
    assert entry["source_sha256"]["image"] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]


def test_nnunet_v2_case_missing_a_channel(tmp_path, capsys):
    src = _nnunet(tmp_path / "Dataset002", np.random.default_rng(7))
    missing = src / "imagesTr" / "BraTS_001_0002.nii.gz"
    missing.unlink()
    code, _, err = run_cli(["convert", src, "-o", tmp_path / "n.h5"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem convert: error: Case 'BraTS_001': no file for channel 2 (T1gd): {missing} is "
                           "missing; dataset.json names 3 channels (FLAIR, T1w, T1gd).")
    assert not (tmp_path / "n.h5").exists()
    code, stdout, err = run_cli(["convert", src, "-o", tmp_path / "n.h5", "--skip-bad"], capsys)
    assert code == 0, err
    assert f"Wrote 1 case to {tmp_path / 'n.h5'}; 1 skipped" in stdout
    assert HDF5VolumeStore(tmp_path / "n.h5").case_ids == ["BraTS_002"]


def test_globs_append_and_force(tmp_path, capsys):
    rng = np.random.default_rng(2)
    data = tmp_path / "raw"
    data.mkdir()
    for case_id in ("p1", "p2", "p3"):
        image, label, affine = _case((9, 10, 11), rng, affine=PLAIN)
        _save(data / f"{case_id}_0000.nii.gz", image, affine)
        _save(data / f"{case_id}.nii.gz", label, affine)
    out = tmp_path / "g.h5"
    code, _, err = run_cli(["convert", "--images", f"{data}/p[12]_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                            "-o", out, "--chunks", "none"], capsys)
    assert code == 0, err
    assert HDF5VolumeStore(out).case_ids == ["p1", "p2"]
    assert HDF5VolumeStore(out).num_classes == 3
    with h5py.File(out) as handle:
        assert handle["cases/p1/image"].chunks is None  # contiguous
    code, _, err = run_cli(["convert", "--images", f"{data}/p[12]_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                            "-o", out, "--chunks", "none", "--force", "--normalization", "none"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["convert", "--images", f"{data}/p3_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                            "-o", out, "--append"], capsys)
    assert code == 0, err
    assert HDF5VolumeStore(out).case_ids == ["p1", "p2", "p3"]
    assert HDF5VolumeStore(out).preprocessing.channels[0].scheme == "none"  # --append keeps the store's scheme
    assert sorted(json.loads((tmp_path / "g.manifest.json").read_text())["cases"]) == ["p1", "p2", "p3"]
    code, _, err = run_cli(["convert", "--images", f"{data}/p3_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                            "-o", out, "--append"], capsys)
    assert code == 1
    assert err.strip() == f"bigmem convert: error: Case 'p3': already in {out} (--append adds new cases only)."
    assert HDF5VolumeStore(out).case_ids == ["p1", "p2", "p3"]  # untouched
    code, _, err = run_cli(["convert", "--images", f"{data}/p1_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                            "-o", out], capsys)
    assert code == 1
    assert "exists: pass --force to overwrite it or --append to add cases." in err
    assert run_cli(["convert", "--images", f"{data}/p1_0000.nii.gz", "--labels", f"{data}/p?.nii.gz",
                    "-o", out, "--force", "--compression", "gzip"], capsys)[0] == 0
    assert HDF5VolumeStore(out).case_ids == ["p1"]


def test_a_converted_store_trains(msd_3d, tmp_path, capsys):
    out = tmp_path / "s.h5"
    assert run_cli(["convert", msd_3d, "-o", out], capsys)[0] == 0
    code, _, err = run_cli(["train", "--data", out, "--model", "tiny", "--volume", 32, "--steps", 2,
                            "--out", tmp_path / "run"], capsys)
    assert code == 0, err


# ---- bad inputs: one line naming the case and file, exit 1, no traceback, nothing left behind ----

def _bad_shape(root, rng):
    image, _, affine = _case((12, 12, 12), rng)
    return {"bad": (image, np.zeros((12, 12, 11), np.uint8), affine)}


def _write_case(root, case_id, image, label, image_affine, label_affine):
    _save(root / "imagesTr" / f"{case_id}.nii.gz", image, image_affine)
    _save(root / "labelsTr" / f"{case_id}.nii.gz", label, label_affine)


BAD = {
    "shape": r"Case 'bad': label shape \(12, 12, 11\) != image shape \(12, 12, 12\) \(.*labelsTr/bad.nii.gz\)\.",
    "affine": r"Case 'bad': label affine differs from the image affine by 0\.5 \(tolerance 0\.001\) "
              r"\(.*labelsTr/bad.nii.gz\); the two are not on the same grid\.",
    "nan": r"Case 'bad': image has 3 non-finite values \(NaN/Inf\) \(.*imagesTr/bad.nii.gz\)\.",
    "label_value": r"Case 'bad': label values \[7\] are not in dataset.json's labels \(0\.\.2\) "
                   r"\(.*labelsTr/bad.nii.gz\)\.",
    "label_4d": r"Case 'bad': label has shape \(12, 12, 12, 2\) \(.*labelsTr/bad.nii.gz\); expected a 3D label "
                r"map",
    "truncated": r"Case 'bad': cannot read image '.*imagesTr/bad.nii.gz' \(.*\); the file may be truncated or "
                 r"not NIfTI\.",
    "not_nifti": r"Case 'bad': cannot read label '.*labelsTr/bad.nii.gz' \(.*\); the file may be truncated or "
                 r"not NIfTI\.",
    "missing": r"Case 'bad': image file '.*imagesTr/bad.nii.gz' does not exist\.",
    "duplicate": r"Case 'good': listed twice in .*dataset.json\.",
}


def _make_bad(kind: str, root: Path) -> Path:
    rng = np.random.default_rng(3)
    good_image, good_label, affine = _case((12, 12, 12), rng)
    make_msd(root, {"good": (good_image, good_label, affine)})
    meta = json.loads((root / "dataset.json").read_text())
    image, label = good_image.copy(), good_label.copy()
    if kind == "shape":
        _write_case(root, "bad", image, label[:, :, :11], affine, affine)
    elif kind == "affine":
        shifted = affine.copy()
        shifted[0, 3] += 0.5
        _write_case(root, "bad", image, label, affine, shifted)
    elif kind == "nan":
        image[0, 0, :3] = [np.nan, np.inf, -np.inf]
        _write_case(root, "bad", image, label, affine, affine)
    elif kind == "label_value":
        label[1, 1, 1] = 7
        _write_case(root, "bad", image, label, affine, affine)
    elif kind == "label_4d":
        _write_case(root, "bad", image, np.stack([label, label], -1), affine, affine)
    elif kind == "truncated":
        _write_case(root, "bad", image, label, affine, affine)
        path = root / "imagesTr" / "bad.nii.gz"
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif kind == "not_nifti":
        _write_case(root, "bad", image, label, affine, affine)
        (root / "labelsTr" / "bad.nii.gz").write_bytes(gzip.compress(b"this is not a NIfTI header" * 20))
    if kind == "duplicate":
        meta["training"].append(dict(meta["training"][0]))
    elif kind != "missing":
        meta["training"].append({"image": "./imagesTr/bad.nii.gz", "label": "./labelsTr/bad.nii.gz"})
    else:
        meta["training"].append({"image": "./imagesTr/bad.nii.gz", "label": "./labelsTr/good.nii.gz"})
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_inputs(kind, tmp_path, capsys):
    src = _make_bad(kind, tmp_path / "src")
    out = tmp_path / "out" / "s.h5"
    code, _, err = run_cli(["convert", src, "-o", out], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "Traceback" not in err
    assert lines[0].startswith("bigmem convert: error: ")
    import re

    assert re.search(BAD[kind], lines[0]), lines[0]
    assert not out.exists() and not list(out.parent.glob("*")) if out.parent.exists() else True


@pytest.mark.parametrize("kind", ["shape", "nan", "duplicate"])
def test_skip_bad_keeps_the_good_cases(kind, tmp_path, capsys):
    src = _make_bad(kind, tmp_path / "src")
    out = tmp_path / "s.h5"
    code, stdout, err = run_cli(["convert", src, "-o", out, "--skip-bad"], capsys)
    assert code == 0, err
    assert "skipped: Case '" in stdout
    assert f"Wrote 1 case to {out}; 1 skipped" in stdout
    assert HDF5VolumeStore(out).case_ids == ["good"]


def test_non_consecutive_labels_in_dataset_json(tmp_path, capsys):
    rng = np.random.default_rng(4)
    src = make_msd(tmp_path / "src", {"a": _case((8, 8, 8), rng)})
    meta = json.loads((src / "dataset.json").read_text())
    meta["labels"] = {"0": "background", "1": "edema", "4": "enhancing"}
    (src / "dataset.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["convert", src, "-o", tmp_path / "s.h5"], capsys)
    assert code == 1
    assert "label values [0, 1, 4] are not 0..2; bigmem needs consecutive labels" in err


@pytest.mark.parametrize("argv, message", [
    ([], "Give SRC (an MSD or nnU-Net v2 folder, its dataset.json, or KiTS case folders), or both --images and "
         "--labels."),
    (["SRC", "--images", "x"], "Give either SRC or --images/--labels, not both."),
    (["SRC", "--chunks", "0"], "Invalid --chunks '0': expected a chunk edge in voxels (e.g. 64) or none."),
    (["SRC", "--chunks", "none", "--compression", "lzf"], "--chunks none writes contiguous datasets, which HDF5 "
                                                          "cannot compress; drop --compression or give a chunk edge."),
    (["SRC", "--append", "--force"], "Give either --append or --force, not both."),
])
def test_usage_errors(tmp_path, capsys, argv, message):
    argv = [str(tmp_path) if a == "SRC" else a for a in argv]
    code, _, err = run_cli(["convert", *argv, "-o", tmp_path / "s.h5"], capsys)
    assert code == 2
    assert err.strip() == f"bigmem convert: error: {message}"


def test_not_an_msd_folder(tmp_path, capsys):
    code, _, err = run_cli(["convert", tmp_path, "-o", tmp_path / "s.h5"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem convert: error: No dataset.json in {str(tmp_path)!r} and no KiTS case folders: "
                           "expected a Medical Segmentation Decathlon or nnU-Net v2 folder (dataset.json, imagesTr/, "
                           "labelsTr/), KiTS case folders (case_00000/imaging.nii.gz, segmentation.nii.gz), or "
                           "--images/--labels globs.")


def test_throttled_writes_are_identical_and_rate_limited(msd_3d, tmp_path, capsys):
    import time

    plain, slow = tmp_path / "plain.h5", tmp_path / "slow.h5"
    assert run_cli(["convert", msd_3d, "-o", plain], capsys)[0] == 0
    started = time.monotonic()
    code, _, err = run_cli(["convert", msd_3d, "-o", slow, "--max-write-rate", "2MB/s", "--block-size", "64KiB"],
                           capsys)
    elapsed = time.monotonic() - started
    assert code == 0, err
    a, b = HDF5VolumeStore(plain), HDF5VolumeStore(slow)
    with h5py.File(plain) as handle:  # the image in its storage dtype, the uint8 label
        written = sum(handle[f"cases/{c.case_id}/{name}"].nbytes for c in a.cases for name in ("image", "label"))
    assert elapsed >= 0.9 * written / 2e6  # the limiter held the average rate (a floor, not a timing target)
    for case_id in a.case_ids:
        for x, y in zip(a.read_case(case_id), b.read_case(case_id)):
            np.testing.assert_array_equal(x, y)


def test_throttle_flag_errors(msd_3d, tmp_path, capsys):
    code, _, err = run_cli(["convert", msd_3d, "-o", tmp_path / "s.h5", "--max-write-rate", "fast"], capsys)
    assert code == 2
    assert err.strip() == ("bigmem convert: error: Invalid --max-write-rate 'fast': expected a size such as 512GiB, "
                           "1.5TiB, 200MB or 1048576.")


def test_spacing_resamples_and_keeps_world_positions(tmp_path, capsys):
    rng = np.random.default_rng(5)
    affine = np.diag([2.0, 1.0, 3.0, 1.0])
    affine[:3, 3] = [-10.0, 5.0, 7.0]
    image = rng.normal(size=(10, 20, 8)).astype(np.float32)
    label = np.zeros((10, 20, 8), np.uint8)
    label[2:6, 5:15, 1:5] = 2
    src = make_msd(tmp_path / "src", {"r": (image, label, affine)})
    out = tmp_path / "s.h5"
    code, _, err = run_cli(["convert", src, "-o", out, "--spacing", "1,1,1"], capsys)
    assert code == 0, err
    with h5py.File(out) as handle:
        group = handle["cases/r"]
        assert group["image"].shape == (20, 20, 24, 1)
        np.testing.assert_allclose(group.attrs["spacing"], [1.0, 1.0, 1.0])
        new_affine = group.attrs["affine"]
        assert set(np.unique(group["label"][...])) == {0, 2}  # nearest: no invented labels
    # The field of view's corner (voxel -0.5) sits at the same world point before and after.
    corner = lambda a: a[:3, :3] @ np.full(3, -0.5) + a[:3, 3]  # noqa: E731
    np.testing.assert_allclose(corner(new_affine), corner(affine))
    np.testing.assert_allclose(np.linalg.norm(new_affine[:3, :3], axis=0), [1.0, 1.0, 1.0])
    code, _, err = run_cli(["convert", src, "-o", tmp_path / "t.h5", "--spacing", "1,0,1"], capsys)
    assert code == 2
    assert "Invalid --spacing '1,0,1': expected three positive numbers (mm)" in err
    # 2 mm does not divide the 20 mm x 20 mm x 24 mm field of view on its last axis: 12 voxels of 2 mm
    # does, 3.5 mm gives round(24 / 3.5) = 7 voxels of 3.43 mm, and convert says so
    code, stdout, err = run_cli(["convert", src, "-o", tmp_path / "u.h5", "--spacing", "2,2,3.5"], capsys)
    assert code == 0, err
    assert ("note: --spacing 2,2,3.5: each case is resampled to a whole number of voxels over its field of view, "
            "so its spacing is the nearest that gives one (furthest: 'r' at 2x2x3.429 mm, 2.04% off)") in stdout
    code, stdout, _ = run_cli(["convert", src, "-o", tmp_path / "v.h5", "--spacing", "2,2,2"], capsys)
    assert code == 0
    assert "note: --spacing" not in stdout


def test_an_append_of_other_channels_names_the_flag(tmp_path, capsys):
    rng = np.random.default_rng(7)
    (tmp_path / "lab").mkdir()
    for case_id, channels in (("p1", 1), ("p2", 2)):
        image, label, affine = _case((9, 10, 11), rng, affine=PLAIN, channels=channels)
        _save(tmp_path / f"{case_id}.nii.gz", image, affine)
        _save(tmp_path / "lab" / f"{case_id}.nii.gz", label, affine)
    out = tmp_path / "g.h5"
    code, _, err = run_cli(["convert", "--images", f"{tmp_path}/p1.nii.gz", "--labels", f"{tmp_path}/lab/*.nii.gz",
                            "-o", out], capsys)
    assert code == 0, err
    code, _, err = run_cli(["convert", "--images", f"{tmp_path}/p2.nii.gz", "--labels", f"{tmp_path}/lab/*.nii.gz",
                            "-o", out, "--append"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem convert: error: Case 'p2': image has 2 channels; --append: the store 'g.h5' has "
                           f"1 ({tmp_path / 'p2.nii.gz'}).")
