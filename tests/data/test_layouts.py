"""Dataset layouts: MSD, nnU-Net v2 raw (channel files, regions) and KiTS case folders, detected and listed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from bigmem.data.layouts import (Layout, describe_dataset, detect_layout, list_images, list_labels, read_dataset,
                                 read_globs, read_kits)
from bigmem.data.nifti import load_channels
from bigmem.data.store import HDF5VolumeStore
from bigmem.errors import DataError
from helpers import make_kits, run_cli, save_nifti

SHAPE = (10, 12, 8)
BRATS_REGIONS = {"background": 0, "whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}


def make_nnunet(root: Path, cases=("BraTS_001", "BraTS_002"), *, channels=("FLAIR", "T1w"), labels=None,
                tests=(), **extra) -> Path:
    """An nnU-Net v2 raw folder: imagesTr/CASE_000c.nii.gz per channel, labelsTr/CASE.nii.gz, imagesTs/."""
    rng = np.random.default_rng(0)
    labels = labels or {"background": 0, "edema": 1, "tumour": 2}
    root.mkdir(parents=True, exist_ok=True)
    for case_id in cases:
        for c in range(len(channels)):
            save_nifti(root / "imagesTr" / f"{case_id}_{c:04d}.nii.gz", rng.normal(c, 1, SHAPE).astype(np.float32))
        save_nifti(root / "labelsTr" / f"{case_id}.nii.gz", rng.integers(0, 3, SHAPE).astype(np.uint8))
    for case_id in tests:
        for c in range(len(channels)):
            save_nifti(root / "imagesTs" / f"{case_id}_{c:04d}.nii.gz", np.zeros(SHAPE, np.float32))
    meta = {"channel_names": {str(i): c for i, c in enumerate(channels)}, "labels": labels,
            "numTraining": len(cases), "file_ending": ".nii.gz", **extra}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def make_msd(root: Path, cases=("a", "b"), *, test=None) -> Path:
    for case_id in cases:
        save_nifti(root / "imagesTr" / f"{case_id}.nii.gz", np.zeros(SHAPE + (2,), np.float32))
        save_nifti(root / "labelsTr" / f"{case_id}.nii.gz", np.zeros(SHAPE, np.uint8))
    meta = {"modality": {"0": "T1", "1": "T2"}, "labels": {"0": "background", "1": "lesion"},
            "training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in cases]}
    if test is not None:
        for case_id in test:
            save_nifti(root / "imagesTs" / f"{case_id}.nii.gz", np.zeros(SHAPE + (2,), np.float32))
        meta["test"] = [f"./imagesTs/{c}.nii.gz" for c in test]
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _meta(root: Path, **changes) -> None:
    meta = json.loads((root / "dataset.json").read_text())
    meta.update(changes)
    (root / "dataset.json").write_text(json.dumps(meta))


# ---- detection and listing for convert -----------------------------------------------------


def test_each_layout_is_detected(tmp_path):
    assert detect_layout(make_msd(tmp_path / "Task05")) is Layout.MSD
    assert detect_layout(make_nnunet(tmp_path / "Dataset001_BraTS")) is Layout.NNUNET
    kits = make_kits(tmp_path / "kits", {"case_00000": (SHAPE, (0, 1, 2))})
    assert detect_layout(kits) is Layout.KITS
    assert detect_layout(kits / "case_00000") is Layout.KITS_CASE
    save_nifti(tmp_path / "loose" / "scan.nii.gz", np.zeros(SHAPE, np.float32))
    assert detect_layout(tmp_path / "loose") is Layout.FILES
    (tmp_path / "empty").mkdir()
    assert detect_layout(tmp_path / "empty") is None


def test_nnunet_cases_list_every_channel_file_in_order(tmp_path):
    root = make_nnunet(tmp_path / "Dataset001_BraTS", cases=("BraTS_002", "BraTS_001"))
    dataset = read_dataset(root)
    assert [c.case_id for c in dataset.cases] == ["BraTS_001", "BraTS_002"]
    assert dataset.cases[0].image_files == [root / "imagesTr" / "BraTS_001_0000.nii.gz",
                                            root / "imagesTr" / "BraTS_001_0001.nii.gz"]
    assert dataset.cases[0].label == root / "labelsTr" / "BraTS_001.nii.gz"
    assert (dataset.layout, dataset.regions, dataset.notes, dataset.problems) == (Layout.NNUNET, {}, [], [])
    assert describe_dataset(dataset) == ("nnU-Net v2 raw: 2 channels (FLAIR, T1w), 3 classes (background, edema, "
                                         "tumour), 2 training cases")


def test_nnunet_problems_name_the_case_and_the_file(tmp_path):
    root = make_nnunet(tmp_path / "Dataset002", cases=("a", "b", "c", "d"))
    (root / "imagesTr" / "b_0001.nii.gz").unlink()
    save_nifti(root / "imagesTr" / "c_0002.nii.gz", np.zeros(SHAPE, np.float32))
    (root / "labelsTr" / "d.nii.gz").unlink()
    save_nifti(root / "imagesTr" / "e.nii.gz", np.zeros(SHAPE, np.float32))
    _meta(root, numTraining=5)
    dataset = read_dataset(root)
    assert [c.case_id for c in dataset.cases] == ["a"]
    images = root / "imagesTr"
    assert dataset.problems == [
        f"{images / 'e.nii.gz'}: no channel suffix; nnU-Net v2 names image files CASE_0000.nii.gz (channel 0), "
        f"CASE_0001.nii.gz, ... (read as nnU-Net v2 because {root / 'dataset.json'} has 'channel_names' and no "
        "'training' list of MSD cases).",
        f"Case 'b': no file for channel 1 (T1w): {images / 'b_0001.nii.gz'} is missing; dataset.json names 2 "
        "channels (FLAIR, T1w).",
        f"Case 'c': {images / 'c_0002.nii.gz'} is channel 2, but dataset.json names 2 channels (FLAIR, T1w).",
        f"Case 'd': no label {root / 'labelsTr' / 'd.nii.gz'} (nnU-Net v2 keeps labelsTr/CASE.nii.gz for "
        "imagesTr/CASE_0000.nii.gz).",
    ]
    assert dataset.notes == [f"{root / 'dataset.json'} says numTraining 5; {images} holds 4 cases."]


def test_nnunet_folder_without_images_or_with_another_file_ending(tmp_path):
    root = make_nnunet(tmp_path / "Dataset003", cases=())
    with pytest.raises(DataError, match=re.escape(
            f"{root / 'dataset.json'} has no 'training' list (MSD) and {root / 'imagesTr'} no nnU-Net v2 training "
            "images: expected imagesTr/CASE_0000.nii.gz (one file per channel) and labelsTr/CASE.nii.gz.")):
        read_dataset(root)
    _meta(root, file_ending=".mha")
    with pytest.raises(DataError, match=re.escape(
            f"{root / 'dataset.json'}: 'file_ending' is \".mha\"; bigmem reads NIfTI files (\".nii.gz\" or \".nii\"): "
            "convert the images to NIfTI first.")):
        read_dataset(root)


def test_regions_train_as_the_painted_label_values(tmp_path):
    root = make_nnunet(tmp_path / "Dataset137_BraTS", labels=BRATS_REGIONS, regions_class_order=[1, 2, 3])
    dataset = read_dataset(root)
    assert dataset.label_names == ["background", "whole_tumor", "tumor_core", "enhancing_tumor"]
    assert dataset.regions == {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}
    assert dataset.notes == ["Regions (whole_tumor: 1, 2, 3; tumor_core: 2, 3; enhancing_tumor: 3) are trained as 4 "
                             "classes (the label values 0..3 that regions_class_order paints) and scored as regions."]
    # class v is named after the region painted v, whatever the order of 'labels'
    _meta(root, labels={"background": 0, "inner": [2], "outer": [1, 2]}, regions_class_order=[2, 1])
    dataset = read_dataset(root)
    assert dataset.label_names == ["background", "outer", "inner"]
    assert dataset.regions == {"inner": [2], "outer": [1, 2]}


@pytest.mark.parametrize("labels, order, message", [
    (BRATS_REGIONS, None,
     "'labels' gives regions (whole_tumor: [1, 2, 3]; tumor_core: [2, 3]; enhancing_tumor: [3]) but no "
     "'regions_class_order'; add \"regions_class_order\" (the label value the label files hold for each region, in "
     "the order of 'labels', as nnU-Net v2 writes it), or give each label a single value."),
    (BRATS_REGIONS, [1, 2, 4],
     "'regions_class_order' [1, 2, 4] is not the label values 1..3, one per region (whole_tumor: [1, 2, 3]; "
     "tumor_core: [2, 3]; enhancing_tumor: [3]); bigmem trains the label files' values 0..3 as classes: remap the "
     "label files, or give each label a single value."),
    ({"background": 0, "whole_tumor": [1, 2, 4], "tumor_core": [2, 4], "enhancing_tumor": [4]}, [1, 2, 3],
     "region 'whole_tumor' [1, 2, 4]: label values [4] are not among the label files' 1..3 (regions_class_order "
     "[1, 2, 3]); map each region to the label values its class order paints, or give each label a single value."),
    (BRATS_REGIONS, [3, 2, 1],
     "region 'enhancing_tumor' [3]: it does not hold 1, its regions_class_order value (regions_class_order [3, 2, 1]); "
     "map each region to the label values its class order paints, or give each label a single value."),
    ({"whole_tumor": [1, 2], "core": [2]}, [1, 2],
     "'labels' defines regions but no background (a label with value 0), such as {\"background\": 0, "
     "\"whole_tumor\": [1, 2, 3]}."),
])
def test_bad_regions_say_how_to_map_them(tmp_path, labels, order, message):
    extra = {} if order is None else {"regions_class_order": order}
    root = make_nnunet(tmp_path / "Dataset137", labels=labels, **extra)
    with pytest.raises(DataError, match=f"^{re.escape(str(root / 'dataset.json') + ': ' + message)}$"):
        read_dataset(root)


def test_regions_reach_the_store_and_its_manifest(tmp_path, capsys):
    root = make_nnunet(tmp_path / "Dataset137", labels=BRATS_REGIONS, regions_class_order=[1, 2, 3])
    out = tmp_path / "brats.h5"
    code, stdout, err = run_cli(["convert", root, "-o", out], capsys)
    assert code == 0, err
    assert stdout.splitlines()[:2] == [
        "nnU-Net v2 raw: 2 channels (FLAIR, T1w), 4 classes (background, whole_tumor, tumor_core, enhancing_tumor), "
        "2 training cases",
        "Regions (whole_tumor: 1, 2, 3; tumor_core: 2, 3; enhancing_tumor: 3) are trained as 4 classes (the label "
        "values 0..3 that regions_class_order paints) and scored as regions."]
    with HDF5VolumeStore(out) as store:
        assert store.regions == {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}
        assert store.num_classes == 4
        assert store.num_channels == 2
    assert json.loads((tmp_path / "brats.manifest.json").read_text())["regions"] == store.regions


def test_store_regions_absent_or_damaged(tmp_path, tiny_store):
    import h5py

    assert HDF5VolumeStore(tiny_store).regions == {}
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(tiny_store.read_bytes())
    with h5py.File(damaged, "a") as handle:
        handle.attrs["regions"] = json.dumps({"whole": [1, 5]})  # the store has 3 classes
    with pytest.raises(DataError, match=re.escape(
            f"Store {str(damaged)!r}: region 'whole' has label values [5]; expected labels 1..2 (background belongs "
            "to no region).")):
        HDF5VolumeStore(damaged)


def test_kits_case_ids_are_the_folder_names_and_test_cases_are_skipped(tmp_path, capsys):
    kits = make_kits(tmp_path / "kits", {"case_00000": ((12, 12, 10), (0, 1, 2)), "case_00001": (SHAPE, (0, 1)),
                                         "case_00002": (SHAPE, None)})
    dataset = read_dataset(kits)
    assert [c.case_id for c in dataset.cases] == ["case_00000", "case_00001"]
    assert dataset.cases[0].image == kits / "case_00000" / "imaging.nii.gz"
    assert dataset.notes == ["Skipped 1 test case (case folders without segmentation.nii.gz): case_00002."]
    assert describe_dataset(dataset) == ("KiTS case folders: 1 channel (CT), 3 classes (background, kidney, tumor; "
                                         "cyst too where a label holds 3), 2 training cases")
    out = tmp_path / "kits.h5"
    code, stdout, err = run_cli(["convert", kits, "-o", out], capsys)
    assert code == 0, err
    assert stdout.splitlines()[1] == "Skipped 1 test case (case folders without segmentation.nii.gz): case_00002."
    assert f"Wrote 2 cases to {out}; manifest" in stdout
    with HDF5VolumeStore(out) as store:
        assert store.case_ids == ["case_00000", "case_00001"]
        assert (store.num_classes, store.label_names, store.channel_names) == (
            3, ["background", "kidney", "tumor"], ["CT"])


def test_kits21_cyst_adds_the_fourth_class(tmp_path, capsys):
    kits = make_kits(tmp_path / "kits21", {"case_00000": ((12, 12, 10), (0, 1, 2, 3))})
    out = tmp_path / "kits21.h5"
    code, stdout, err = run_cli(["convert", kits / "case_00000", "-o", out], capsys)  # one case folder
    assert code == 0, err
    assert stdout.startswith("KiTS case folder: 1 channel (CT), 3 classes (background, kidney, tumor; cyst too where "
                             "a label holds 3), 1 training case\n")
    assert f"Wrote 1 case to {out}" in stdout
    with HDF5VolumeStore(out) as store:
        assert store.case_ids == ["case_00000"]
        assert (store.num_classes, store.label_names) == (4, ["background", "kidney", "tumor", "cyst"])
    make_kits(kits, {"case_00001": ((12, 12, 10), (0, 5))})
    code, _, err = run_cli(["convert", kits, "-o", tmp_path / "bad.h5"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem convert: error: Case 'case_00001': label values [5] are not in KiTS's labels "
                           f"(0..3) ({kits / 'case_00001' / 'segmentation.nii.gz'}).")


def test_kits_folder_of_test_cases_only(tmp_path):
    kits = make_kits(tmp_path / "kits", {"case_00300": (SHAPE, None), "case_00301": (SHAPE, None)})
    with pytest.raises(DataError, match=re.escape(
            f"No KiTS training cases in {str(kits)!r}: none of its 2 case folders has a segmentation.nii.gz (test "
            "cases are segmented with 'bigmem predict').")):
        read_kits(kits)


def test_a_glob_of_one_channel_says_so(tmp_path, capsys):
    root = make_nnunet(tmp_path / "Dataset001", channels=("FLAIR", "T1w", "T1gd", "T2w"))
    images = f"{root}/imagesTr/*_0000.nii.gz"
    dataset = read_globs(images, f"{root}/labelsTr/*.nii.gz")
    assert [c.case_id for c in dataset.cases] == ["BraTS_001", "BraTS_002"]
    warning = (f"--images {images!r} matches one channel file of 2 cases with 4 channel files beside it (e.g. "
               f"BraTS_001_0000.nii.gz of BraTS_001_0000.nii.gz .. BraTS_001_0003.nii.gz): only that channel is "
               f"converted. To convert all 4 channels, give the dataset folder {str(root)!r} as SRC.")
    assert dataset.notes == [warning]
    code, stdout, err = run_cli(["convert", "--images", images, "--labels", f"{root}/labelsTr/*.nii.gz",
                                 "-o", tmp_path / "one.h5"], capsys)
    assert code == 0, err
    assert stdout.splitlines()[:2] == ["--images/--labels: 2 training cases; channels and classes from the data",
                                       warning]
    assert HDF5VolumeStore(tmp_path / "one.h5").num_channels == 1
    assert read_globs(f"{root}/labelsTr/*.nii.gz", f"{root}/labelsTr/*.nii.gz").notes == []  # no channel files


def test_msd_is_still_read(tmp_path):
    dataset = read_dataset(make_msd(tmp_path / "Task05_Prostate"))
    assert [c.case_id for c in dataset.cases] == ["a", "b"]
    assert dataset.layout is Layout.MSD
    assert describe_dataset(dataset) == ("Medical Segmentation Decathlon: 2 channels (T1, T2), 2 classes "
                                         "(background, lesion), 2 training cases")


# ---- a layout that is neither, or two at once: the message says what was tried and why ------------


def test_a_dataset_json_without_training_or_channel_names_is_named(tmp_path, capsys):
    root = make_msd(tmp_path / "Task05")
    meta = json.loads((root / "dataset.json").read_text())
    del meta["training"]
    (root / "dataset.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["convert", root, "-o", tmp_path / "out.h5"], capsys)
    assert code == 1
    assert err.startswith(f"bigmem convert: error: {root / 'dataset.json'} lists no training cases and has no "
                          "channel_names: it is neither a Medical Segmentation Decathlon dataset.json")
    assert "channel suffix" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.h5").exists()


def test_msd_files_under_an_nnunet_dataset_json_say_why_nnunet(tmp_path, capsys):
    root = make_msd(tmp_path / "Task05")
    meta = json.loads((root / "dataset.json").read_text())
    del meta["training"]
    meta["channel_names"] = meta.pop("modality")
    (root / "dataset.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["convert", root, "-o", tmp_path / "out.h5"], capsys)
    assert code == 1
    assert f"{root / 'imagesTr' / 'a.nii.gz'}: no channel suffix" in err
    assert (f"(read as nnU-Net v2 because {root / 'dataset.json'} has 'channel_names' and no 'training' list of MSD "
            "cases).") in err


def test_a_dataset_json_beside_kits_case_folders_says_which_was_read(tmp_path, capsys):
    root = make_kits(tmp_path / "kits", {"case_00000": (SHAPE, (0, 1, 2))})
    (root / "dataset.json").write_text(json.dumps({"channel_names": {"0": "CT"},
                                                   "labels": {"background": 0, "kidney": 1}}))
    code, _, err = run_cli(["convert", root, "-o", tmp_path / "out.h5"], capsys)
    assert code == 1
    assert (f"Read as nnU-Net v2 raw because {root / 'dataset.json'} has 'channel_names' and no 'training' list; "
            f"{str(root)!r} also holds KiTS case folders, read as such only where no dataset.json is beside "
            "them.") in err


def test_images_and_labels_without_a_dataset_json_say_it_is_missing(tmp_path, capsys):
    root = make_msd(tmp_path / "Task05")
    (root / "dataset.json").unlink()
    code, _, err = run_cli(["convert", root, "-o", tmp_path / "out.h5"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem convert: error: No dataset.json in {str(root)!r}, which has imagesTr/ and "
                           "labelsTr/: a Medical Segmentation Decathlon or nnU-Net v2 folder is read through its "
                           "dataset.json (channels, labels, and MSD's list of cases); add it, or give "
                           "--images/--labels globs.")


def test_load_channels_checks_every_channel_file(tmp_path):
    rng = np.random.default_rng(1)
    a = save_nifti(tmp_path / "c_0000.nii.gz", rng.normal(size=SHAPE).astype(np.float32))
    b = save_nifti(tmp_path / "c_0001.nii.gz", rng.normal(size=SHAPE).astype(np.float32))
    loaded = load_channels([a, b], "c", num_channels=2)
    assert loaded.image.shape == SHAPE + (2,)
    np.testing.assert_array_equal(loaded.image[..., 1], np.asanyarray(__import__("nibabel").load(str(b)).dataobj))
    with pytest.raises(DataError, match=re.escape(f"Case 'c': 2 channel files; dataset.json names 3 ({a}, {b}).")):
        load_channels([a, b], "c", num_channels=3)
    shifted = save_nifti(tmp_path / "c_0002.nii.gz", np.zeros(SHAPE, np.float32), np.diag([2.0, 1, 1, 1]))
    with pytest.raises(DataError, match=re.escape(f"Case 'c': {shifted} is not on the grid of {a} (shape {SHAPE} vs "
                                                  f"{SHAPE}, or a different affine).")):
        load_channels([a, shifted], "c")
    both = save_nifti(tmp_path / "two.nii.gz", np.zeros(SHAPE + (2,), np.float32))
    with pytest.raises(DataError, match=re.escape(f"Case 'c': {both} has 2 channels; expected one 3D file per "
                                                  "channel when several files are given.")):
        load_channels([a, both], "c")


# ---- listing for predict ------------------------------------------------------------------


def test_predict_listing_of_each_layout(tmp_path):
    nnunet = make_nnunet(tmp_path / "Dataset001", tests=("BraTS_101", "BraTS_100"))
    listing = list_images(nnunet)
    assert listing.cases == {case: [nnunet / "imagesTs" / f"{case}_{c:04d}.nii.gz" for c in (0, 1)]
                             for case in ("BraTS_100", "BraTS_101")}
    assert listing.summary == f"nnU-Net v2 raw: 2 cases of 2 channel files in {nnunet / 'imagesTs'}"
    assert list(list_images(make_nnunet(tmp_path / "Dataset002")).cases) == ["BraTS_001", "BraTS_002"]  # imagesTr
    msd = make_msd(tmp_path / "Task05", test=("t1",))
    assert list_images(msd).cases == {"t1": [msd / "imagesTs" / "t1.nii.gz"]}
    kits = make_kits(tmp_path / "kits", {"case_00000": (SHAPE, (0, 1)), "case_00001": (SHAPE, None)})
    listing = list_images(kits)
    assert listing.cases == {c: [kits / c / "imaging.nii.gz"] for c in ("case_00000", "case_00001")}
    assert listing.summary == f"KiTS case folders: 2 cases in {kits}"
    assert list_images(kits / "case_00001").cases == {"case_00001": [kits / "case_00001" / "imaging.nii.gz"]}
    single = list_images(kits / "case_00001" / "imaging.nii.gz")  # named after its folder, not 'imaging'
    assert list(single.cases) == ["case_00001"]
    assert single.layout is Layout.FILE
    loose = tmp_path / "loose"
    for name in ("x_0000.nii.gz", "x_0001.nii.gz", "y.nii"):
        save_nifti(loose / name, np.zeros(SHAPE, np.float32))
    assert list_images(loose).cases == {"x": [loose / "x_0000.nii.gz", loose / "x_0001.nii.gz"],
                                        "y": [loose / "y.nii"]}


@pytest.mark.parametrize("names, message", [
    (("a.nii", "a.nii.gz"), "Case 'a': {d}/a.nii and {d}/a.nii.gz would both be segmented into a.nii.gz; rename one "
                            "of them, or predict them into different folders."),
    (("a.nii.gz", "a_0000.nii.gz"), "Case 'a': {d}/a.nii.gz and {d}/a_0000.nii.gz would both be segmented into "
                                    "a.nii.gz; rename one of them, or predict them into different folders."),
    (("s_0001.nii.gz", "s_0002.nii.gz"), "Case 's': channel files s_0001.nii.gz, s_0002.nii.gz in {d} but no s_0000 "
                                         "file: nnU-Net names the channel files of a case CASE_0000, CASE_0001, ... "
                                         "with none left out; rename the files if each is a case of its own."),
])
def test_predict_listing_refuses_two_inputs_for_one_output(tmp_path, names, message):
    for name in names:
        save_nifti(tmp_path / name, np.zeros(SHAPE, np.float32))
    with pytest.raises(DataError, match=f"^{re.escape(message.format(d=tmp_path))}$"):
        list_images(tmp_path)


def test_predict_listing_errors(tmp_path):
    nnunet = make_nnunet(tmp_path / "Dataset001", tests=("BraTS_100",))
    (nnunet / "imagesTs" / "BraTS_100_0001.nii.gz").unlink()
    with pytest.raises(DataError, match=re.escape(
            f"Case 'BraTS_100': no file for channel 1 (T1w): {nnunet / 'imagesTs' / 'BraTS_100_0001.nii.gz'} is "
            "missing; dataset.json names 2 channels (FLAIR, T1w).")):
        list_images(nnunet)
    msd = make_msd(tmp_path / "Task05", test=("t1",))
    (msd / "imagesTs" / "t1.nii.gz").unlink()
    with pytest.raises(DataError, match=re.escape(f"{msd / 'dataset.json'} lists test image "
                                                  f"{msd / 'imagesTs' / 't1.nii.gz'}, which does not exist.")):
        list_images(msd)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=re.escape(f"No NIfTI files (.nii, .nii.gz) in {str(tmp_path / 'empty')!r}: "
                                                  "expected NIfTI files, or a Medical Segmentation Decathlon")):
        list_images(tmp_path / "empty")


# ---- listing for evaluate: the reference label maps ----------------------------------------------


def test_label_listing_of_an_nnunet_folder_takes_labels_tr_and_ts(tmp_path):
    root = make_nnunet(tmp_path / "Dataset001", tests=("BraTS_100",))
    save_nifti(root / "labelsTs" / "BraTS_100.nii.gz", np.zeros(SHAPE, np.uint8))
    listing = list_labels(root)
    assert listing.layout is Layout.NNUNET
    assert listing.cases == {"BraTS_001": root / "labelsTr" / "BraTS_001.nii.gz",
                             "BraTS_002": root / "labelsTr" / "BraTS_002.nii.gz",
                             "BraTS_100": root / "labelsTs" / "BraTS_100.nii.gz"}
    assert listing.where == (root / "labelsTr", root / "labelsTs")
    assert listing.dataset_json == root / "dataset.json"


def test_label_listing_ids_are_the_ids_predict_writes(tmp_path):
    nnunet = make_nnunet(tmp_path / "Dataset001")
    assert list(list_labels(nnunet).cases) == list(list_images(nnunet).cases)
    msd = make_msd(tmp_path / "Task05", cases=("la_003", "la_004"))
    assert list(list_labels(msd).cases) == list(list_images(msd).cases)
    kits = make_kits(tmp_path / "kits", {"case_00000": (SHAPE, (0, 1)), "case_00001": (SHAPE, (0, 2))})
    assert list(list_labels(kits).cases) == list(list_images(kits).cases)


def test_label_listing_of_an_msd_folder_pairs_training_labels_with_their_images(tmp_path):
    root = make_msd(tmp_path / "Task05", test=("t1",))
    save_nifti(root / "labelsTs" / "t1.nii.gz", np.zeros(SHAPE, np.uint8))
    listing = list_labels(root)
    assert listing.layout is Layout.MSD
    assert listing.cases == {"a": root / "labelsTr" / "a.nii.gz", "b": root / "labelsTr" / "b.nii.gz",
                             "t1": root / "labelsTs" / "t1.nii.gz"}


def test_label_listing_of_kits_folders_leaves_test_cases_out(tmp_path):
    kits = make_kits(tmp_path / "kits", {"case_00000": (SHAPE, (0, 1)), "case_00001": (SHAPE, None)})
    listing = list_labels(kits)
    assert listing.cases == {"case_00000": kits / "case_00000" / "segmentation.nii.gz"}
    assert listing.label_names == ("background", "kidney", "tumor", "cyst")
    assert list(list_labels(kits / "case_00000").cases) == ["case_00000"]
    with pytest.raises(DataError, match=re.escape(f"No KiTS segmentation in {str(kits / 'case_00001')!r}: none of "
                                                  "its 1 case folder has a segmentation.nii.gz")):
        list_labels(kits / "case_00001")


def test_label_listing_of_a_folder_of_label_maps(tmp_path):
    root = make_msd(tmp_path / "Task05")
    listing = list_labels(root / "labelsTr")
    assert listing.layout is Layout.FILES
    assert listing.cases == {"a": root / "labelsTr" / "a.nii.gz", "b": root / "labelsTr" / "b.nii.gz"}
    assert listing.dataset_json == (root / "dataset.json").absolute()


def test_label_listing_errors(tmp_path):
    root = make_nnunet(tmp_path / "Dataset001")
    save_nifti(root / "labelsTs" / "BraTS_001.nii.gz", np.zeros(SHAPE, np.uint8))
    with pytest.raises(DataError, match=re.escape(
            f"Case 'BraTS_001': two label maps, {root / 'labelsTr' / 'BraTS_001.nii.gz'} and "
            f"{root / 'labelsTs' / 'BraTS_001.nii.gz'}; expected one per case.")):
        list_labels(root)
    msd = make_msd(tmp_path / "Task05")
    (msd / "labelsTr" / "b.nii.gz").unlink()
    with pytest.raises(DataError, match=re.escape(
            f"{msd / 'dataset.json'} lists label {msd / 'labelsTr' / 'b.nii.gz'} (for image "
            f"{msd / 'imagesTr' / 'b.nii.gz'}), which does not exist.")):
        list_labels(msd)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=re.escape(f"No NIfTI label maps (.nii, .nii.gz) in "
                                                  f"{str(tmp_path / 'empty')!r}: expected label maps named ")):
        list_labels(tmp_path / "empty")


def test_a_dataset_folder_without_labels_says_which_layout_was_read(tmp_path):
    root = make_nnunet(tmp_path / "Dataset001")
    for label in (root / "labelsTr").iterdir():
        label.unlink()
    with pytest.raises(DataError, match=re.escape(
            f"No label maps in {str(root)!r} (nnU-Net v2 raw folder): expected labelsTr/ (and labelsTs/) label maps, "
            f"one per case. Read as nnU-Net v2 raw because {root / 'dataset.json'} has 'channel_names' and no "
            "'training' list.")):
        list_labels(root)
