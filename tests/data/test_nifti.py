"""dataset.json: MSD's and nnU-Net v2's labels, and nnU-Net v2's regions."""

from __future__ import annotations

import json

import pytest

from bigmem.data.nifti import read_dataset_json
from bigmem.errors import DataError


def _write(tmp_path, labels) -> str:
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"channel_names": {"0": "FLAIR"}, "labels": labels}))
    return path


@pytest.mark.parametrize("labels", [{"0": "background", "1": "edema", "2": "enhancing"},  # MSD
                                    {"background": 0, "edema": 1, "enhancing": 2}])  # nnU-Net v2
def test_class_labels_have_names_and_no_regions(tmp_path, labels):
    meta = read_dataset_json(_write(tmp_path, labels))
    assert meta["label_names"] == ["background", "edema", "enhancing"]
    assert meta["regions"] == {}


def test_nnunet_regions_name_regions_and_leave_values_unnamed(tmp_path):
    meta = read_dataset_json(_write(tmp_path, {"background": 0, "whole_tumor": [3, 1, 2], "tumor_core": [2, 3],
                                               "enhancing_tumor": 3}))
    assert meta["regions"] == {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}
    assert meta["label_names"] == ["background", "class1", "class2", "class3"]


@pytest.mark.parametrize("labels, message", [
    ({"background": 0, "tumour": [1, "x"]}, "label 'tumour' is [1, \"x\"]; expected a label value 0..255 or, for a "
                                            "region, a list of them"),
    ({"background": 0, "tumour": [0, 1]}, "region 'tumour' holds label 0 ([0, 1]); background belongs to no region."),
    ({"tumour": [1, 2], "core": 2}, "'labels' defines regions but no background (a label with value 0)"),
    ({"background": 0, "tumour": []}, "label 'tumour' is []"),
])
def test_bad_regions_are_one_line(tmp_path, labels, message):
    path = _write(tmp_path, labels)
    with pytest.raises(DataError) as caught:
        read_dataset_json(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
