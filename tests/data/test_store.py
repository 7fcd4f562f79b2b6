"""The HDF5 store: the layout docs/store.md describes, atomic writes, and a one-line error per defect."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from bigmem.data.store import STORE_VERSION, HDF5VolumeStore, StoreWriter
from bigmem.data.synth import cached_synthetic_store, make_phantom, write_synthetic_store
from bigmem.errors import DataError


def test_synthetic_store_layout(tiny_store):
    with h5py.File(tiny_store) as handle:
        assert handle.attrs["bigmem_store_version"] == STORE_VERSION
        assert handle.attrs["num_classes"] == 3
        assert list(handle.attrs["channel_names"]) == ["synthetic"]
        assert list(handle.attrs["label_names"]) == ["background", "class1", "class2"]
        case = handle["cases/synth_0002"]
        assert case["image"].shape == (16, 16, 16, 1)
        assert case["image"].dtype == np.float32
        assert case["label"].shape == (16, 16, 16)
        assert case["label"].dtype == np.uint8
        assert case["image"].chunks is not None
        assert case["label"].chunks is not None
        np.testing.assert_array_equal(case.attrs["spacing"], [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(case.attrs["affine"], np.eye(4))
        assert case.attrs["source_image"].startswith("synthetic:")
        for key in ("source_affine", "source_label"):
            assert key in case.attrs


def test_store_reader(tiny_store):
    store = HDF5VolumeStore(tiny_store)
    assert store.case_ids == ["synth_0000", "synth_0001", "synth_0002", "synth_0003"]
    assert (len(store), store.num_channels, store.num_classes) == (4, 1, 3)
    image, label = store.read_case("synth_0001")
    assert image.shape == (16, 16, 16, 1)
    assert label.shape == (16, 16, 16)
    assert repr(store).endswith("memory: 80.00 KiB)")  # 4 cases x 16^3 x (4 + 1) bytes
    store.close()


def test_phantoms_are_deterministic_and_have_every_class():
    a_img, a_lab = make_phantom(np.random.default_rng([3, 0]), (32, 32, 32), 4)
    b_img, b_lab = make_phantom(np.random.default_rng([3, 0]), (32, 32, 32), 4)
    c_img, _ = make_phantom(np.random.default_rng([4, 0]), (32, 32, 32), 4)
    np.testing.assert_array_equal(a_img, b_img)
    np.testing.assert_array_equal(a_lab, b_lab)
    assert not np.array_equal(a_img, c_img)
    fractions = np.bincount(a_lab.ravel(), minlength=4) / a_lab.size
    assert fractions[0] > 0.5, fractions
    assert all(f > 0.002 for f in fractions[1:]), fractions
    # Odd classes are darker than the body, even classes brighter.
    means = [a_img[..., 0][a_lab == k].mean() for k in range(4)]
    body = a_img[..., 0][(a_lab == 0) & (np.abs(a_img[..., 0]) > 0.6)].mean()
    assert means[1] < body < means[2]


def test_cached_synthetic_store_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMEM_CACHE_DIR", str(tmp_path))
    first = cached_synthetic_store(num_cases=2, volume=8, num_classes=3)
    mtime = first.stat().st_mtime_ns
    second = cached_synthetic_store(num_cases=2, volume=8, num_classes=3)
    assert second == first
    assert second.stat().st_mtime_ns == mtime
    assert cached_synthetic_store(num_cases=3, volume=8, num_classes=3) != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_writer_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "s.h5"
    with pytest.raises(DataError, match=r"^Case 'a' appears twice\.$"):
        with StoreWriter(target, num_classes=2, channel_names=["ct"]) as writer:
            writer.add_case("a", np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8))
            writer.add_case("a", np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_writer_without_commit_leaves_nothing(tmp_path):
    with StoreWriter(tmp_path / "s.h5", num_classes=2, channel_names=["ct"]) as writer:
        writer.add_case("a", np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8))
    assert list(tmp_path.iterdir()) == []


def test_synth_interrupted_leaves_nothing(tmp_path):
    def interrupt(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic_store(tmp_path / "s.h5", num_cases=4, volume=8, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def _drop_root_attrs(handle):
    del handle.attrs["bigmem_store_version"]


def _drop_cases(handle):
    for case in list(handle["cases"]):
        del handle["cases"][case]


def _drop_label(handle):
    del handle["cases/synth_0001/label"]


def _bad_label_shape(handle):
    del handle["cases/synth_0002/label"]
    handle["cases/synth_0002"].create_dataset("label", data=np.zeros((16, 16, 15), np.uint8))


def _bad_channels(handle):
    del handle["cases/synth_0003/image"]
    handle["cases/synth_0003"].create_dataset("image", data=np.zeros((16, 16, 16, 2), np.float32))


def _future_version(handle):
    handle.attrs["bigmem_store_version"] = STORE_VERSION + 1


@pytest.mark.parametrize("mutate, message", [
    (_drop_root_attrs, r"^Cannot open store '.*bad.h5': not a bigmem store \(root attributes "
                       r"'bigmem_store_version' and 'num_classes' are missing\)\.$"),
    (_drop_cases, r"^Store '.*bad.h5' has no cases \(expected groups under /cases\)\.$"),
    (_drop_label, r"^Case 'synth_0001': missing dataset 'label' \(.*bad.h5:/cases/synth_0001\)\.$"),
    (_bad_label_shape, r"^Case 'synth_0002': label shape \(16, 16, 15\) != image shape \(16, 16, 16\) "
                       r"\(.*bad.h5:/cases/synth_0002\)\.$"),
    (_bad_channels, r"^Case 'synth_0003': image has 2 channels; the store's other cases have 1 \(.*bad.h5\)\.$"),
    (_future_version, r"^Cannot open store '.*bad.h5': store version 2 is newer than this bigmem reads \(1\); "
                      r"upgrade bigmem\.$"),
])
def test_layout_errors_on_open(corrupt_store, mutate, message):
    with pytest.raises(DataError, match=message):
        HDF5VolumeStore(corrupt_store(mutate))


def _nan_image(handle):
    data = handle["cases/synth_0000/image"]
    values = data[...]
    values[1, 2, 3, 0] = np.nan
    values[4, 5, 6, 0] = np.inf
    data[...] = values


def _label_out_of_range(handle):
    data = handle["cases/synth_0000/label"]
    values = data[...]
    values[0, 0, 0] = 7
    data[...] = values


@pytest.mark.parametrize("mutate, message", [
    (_nan_image, r"^Case 'synth_0000': image has 2 non-finite values \(NaN/Inf\) \(.*bad.h5\); fix the source "
                 r"and convert again\.$"),
    (_label_out_of_range, r"^Case 'synth_0000': label value 7 >= number of classes 3 \(.*bad.h5\); expected "
                          r"values 0\.\.2: fix the label and convert again\.$"),
])
def test_value_errors_on_read(corrupt_store, mutate, message):
    store = HDF5VolumeStore(corrupt_store(mutate))
    store.read_case("synth_0001")  # the other cases still read
    with pytest.raises(DataError, match=message):
        store.read_case("synth_0000")


def test_missing_and_non_hdf5_files(tmp_path):
    with pytest.raises(DataError, match=r"^Cannot open store '.*nope.h5': no such file\. Create one with "):
        HDF5VolumeStore(tmp_path / "nope.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match=r"^Cannot open store '.*junk.h5': not a readable HDF5 file"):
        HDF5VolumeStore(junk)


def test_truncated_store(tiny_store, tmp_path):
    cut = tmp_path / "cut.h5"
    data = tiny_store.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"^(Cannot open store|Case '.*': cannot read|Store '.*' has no cases)"):
        store = HDF5VolumeStore(cut)
        for case_id in store.case_ids:
            store.read_case(case_id)


@pytest.mark.parametrize("damage", ["cut_off", "missing_label"])
def test_damaged_store_through_train_is_one_line(damage, tiny_store, corrupt_store, tmp_path, capsys):
    from helpers import run_cli

    if damage == "cut_off":  # a store cut off mid-write
        path = tmp_path / "cut.h5"
        data = tiny_store.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    else:
        path = corrupt_store(_drop_label)
    code, _, err = run_cli(["train", "--model", "tiny", "--data", path, "--steps", 1, "--out", tmp_path / "r"],
                           capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("bigmem train: error: ")
    assert "Traceback" not in err
    assert str(path) in lines[0]
    assert not (tmp_path / "r").exists()


# ---- values checked before training: the writer's records, or one scan -----------------------------

def _write(path, labels: dict[str, int], nan_in: str | None = None, num_classes: int = 3):
    """A store of 8x9x10 cases whose label holds ``labels[case]`` at one voxel (a NaN image voxel in ``nan_in``)."""
    rng = np.random.default_rng(0)
    with StoreWriter(path, num_classes=num_classes, channel_names=["x"]) as writer:
        for case_id, value in labels.items():
            image = rng.normal(size=(8, 9, 10, 1)).astype(np.float32)
            if case_id == nan_in:
                image[1, 2, 3, 0] = np.nan
            label = np.zeros((8, 9, 10), np.uint8)
            label[4, 4, 4] = value
            writer.add_case(case_id, image, label)
        writer.commit()
    return path


def _forget_records(path):
    """The store as an older bigmem wrote it: no label_max, no nonfinite_voxels."""
    with h5py.File(path, "r+") as handle:
        for case in handle["cases"].values():
            del case.attrs["label_max"], case.attrs["nonfinite_voxels"]
    return path


def test_the_writer_records_each_case_s_label_max_and_non_finite_voxels(tmp_path):
    with h5py.File(_write(tmp_path / "s.h5", {"a": 2, "b": 0, "c": 1}, nan_in="c"), "r") as handle:
        assert [(int(c.attrs["label_max"]), int(c.attrs["nonfinite_voxels"])) for c in handle["cases"].values()] == [
            (2, 0), (0, 0), (1, 1)]


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "scanned"])
@pytest.mark.parametrize("labels, nan_in, message", [
    ({"a": 1, "b": 5}, None, r"^Case 'b': label value 5 >= number of classes 3 \(.*s\.h5\); expected values 0\.\.2: "
                             r"fix the label and convert again\.$"),
    ({"a": 1, "b": 2}, "a", r"^Case 'a': image has 1 non-finite values \(NaN/Inf\) \(.*s\.h5\); fix the source and "
                            r"convert again\.$"),
], ids=["label-5-of-3-classes", "nan-voxel"])
def test_validate_for_training_refuses_a_bad_case(tmp_path, capsys, recorded, labels, nan_in, message):
    path = _write(tmp_path / "s.h5", labels, nan_in)
    if not recorded:
        _forget_records(path)
    with pytest.raises(DataError, match=message):
        HDF5VolumeStore(path).validate_for_training()
    scanned = "Checking the labels and voxels of 2 cases (the store records none) ...\n"
    assert capsys.readouterr().out == ("" if recorded else scanned)  # one line in a log, not a bar's redraws


def test_validate_for_training_reads_no_voxel_of_a_store_with_records(tmp_path, monkeypatch):
    store = HDF5VolumeStore(_write(tmp_path / "s.h5", {"a": 1, "b": 1, "c": 2}), holdout=1)

    def no_reads(case_id):
        raise AssertionError(f"read {case_id}")

    monkeypatch.setattr(store, "_read_whole", no_reads)
    store.validate_for_training()
    with pytest.raises(DataError, match=r"^Case 'c': label value 2 >= number of classes 2 "):
        store.validate_for_training(2)  # the held-out case is checked too: validation reads it


def test_validate_for_training_scans_an_older_store_once_and_passes_a_good_one(tmp_path, monkeypatch):
    store = HDF5VolumeStore(_forget_records(_write(tmp_path / "s.h5", {"a": 1, "b": 2})))
    read = []
    real = store._read_whole
    monkeypatch.setattr(store, "_read_whole", lambda case_id: read.append(case_id) or real(case_id))
    store.validate_for_training(show_progress=False)
    assert read == ["a", "b"]
