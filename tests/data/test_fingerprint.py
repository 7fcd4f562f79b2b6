"""A store's fingerprint: each case's spacing and shape in the store's axes, and the whole-case topology from it.

The topology's expected values come from nnU-Net v2.8.1 on the same spacings and shapes (in a
benchmark-only venv, /work/nnunet-venv): ``ExperimentPlanner.determine_fullres_target_spacing`` on a
stand-in ``self`` holding them as its fingerprint, ``np.median([compute_new_shape(shape, spacing,
target) ...], 0)`` for the median case, then ``get_pool_and_conv_props(target, median, 4, 999999)``:
target (0.8, 0.8, 2.6), median (48, 48, 13), strides ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 1)),
kernels ((3, 3, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3)), patch (48, 48, 14), divisors (8, 8, 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from bigmem.data.fingerprint import Fingerprint, fingerprint, nonzero_box
from bigmem.data.store import HDF5VolumeStore, StoreWriter
from bigmem.errors import DataError

# (case id, shape (D, H, W), spacing (D, H, W) mm, nonzero box start and size): KiTS-like, thick slices on W
CASES = [("case_0", (48, 48, 10), (0.8, 0.8, 3.0), (4, 6, 1), (40, 36, 8)),
         ("case_1", (48, 48, 12), (0.8, 0.8, 3.0), (0, 0, 0), (48, 48, 12)),
         ("case_2", (48, 48, 14), (0.8, 0.8, 2.5), (10, 2, 3), (20, 44, 9))]


def _write(path, cases=CASES, *, options=None, channels=1):
    with StoreWriter(path, num_classes=2, channel_names=[f"c{i}" for i in range(channels)], chunk_edge=None) as writer:
        for case_id, shape, spacing, start, size in cases:
            image = np.zeros((*shape, channels), np.float32)
            box = tuple(slice(s, s + n) for s, n in zip(start, size))
            image[box + (channels - 1,)] = 1.0  # only the last channel is nonzero
            writer.add_case(case_id, image, np.zeros(shape, np.uint8), spacing=spacing)
        if options is not None:
            writer.set_root_attr("convert_options", json.dumps(options))
        writer.commit()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fingerprint") / "kits_like.h5")


def test_spacings_are_each_cases_attribute_in_store_axis_order(store):
    assert fingerprint(store).spacings == ((0.8, 0.8, 3.0), (0.8, 0.8, 3.0), (0.8, 0.8, 2.5))


def test_shapes_are_the_stored_ones_by_default(store):
    assert fingerprint(store).shapes == ((48, 48, 10), (48, 48, 12), (48, 48, 14))


def test_by_default_the_shapes_are_not_cropped(store):
    assert fingerprint(store).cropped is False


def test_crop_to_nonzero_takes_each_cases_nonzero_box(store):
    assert fingerprint(store, crop_to_nonzero=True).shapes == ((40, 36, 8), (48, 48, 12), (20, 44, 9))


def test_the_cropped_fingerprint_says_so(store):
    assert fingerprint(store, crop_to_nonzero=True).cropped is True


def test_total_voxels_sums_the_cases(store):
    assert fingerprint(store).total_voxels == 48 * 48 * (10 + 12 + 14)


def test_case_ids_are_every_case(store):
    assert fingerprint(store).case_ids == ("case_0", "case_1", "case_2")


def test_held_out_cases_count(store):
    with HDF5VolumeStore(store, holdout=1) as opened:
        assert fingerprint(opened).num_cases == 3


def test_an_open_store_stays_open(store):
    with HDF5VolumeStore(store) as opened:
        fingerprint(opened)
        assert opened.read_case("case_0")[0].shape == (48, 48, 10, 1)


def test_a_store_convert_did_not_resample_says_so(store):
    assert fingerprint(store).resampled is False


def test_a_store_convert_resampled_says_so(tmp_path):
    path = _write(tmp_path / "resampled.h5", options={"spacing": [0.8, 0.8, 3.0], "shape": None})
    assert fingerprint(path).resampled is True


def test_a_case_without_three_positive_spacings_is_refused(tmp_path):
    path = _write(tmp_path / "bad.h5", [("case_0", (8, 8, 8), (1.0, 0.0, 1.0), (0, 0, 0), (8, 8, 8))])
    with pytest.raises(DataError, match="spacing"):
        fingerprint(path)


def test_to_json_uses_nnunets_key_when_cropped(store):
    assert fingerprint(store, crop_to_nonzero=True).to_json()["shapes_after_crop"][0] == [40, 36, 8]


# ---- the topology of the fingerprint (expected values: nnU-Net's, see the module docstring) ------------


def test_target_spacing_takes_the_10th_percentile_of_the_thick_axis(store):
    assert fingerprint(store).target_spacing() == (0.8, 0.8, 2.6)


def test_median_case_at_the_target_spacing(store):
    assert fingerprint(store).median_shape() == (48.0, 48.0, 13.0)


def test_dataset_voxels_is_the_median_case_times_the_cases(store):
    assert fingerprint(store).dataset_voxels() == 89856.0


def test_topology_strides(store):
    assert fingerprint(store).topology().strides == ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 1))


def test_topology_kernels(store):
    assert fingerprint(store).topology().kernel_sizes == ((3, 3, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3))


def test_topology_padded_shape(store):
    assert fingerprint(store).topology().padded_shape == (48, 48, 14)


def test_topology_divisors(store):
    assert fingerprint(store).topology().divisors == (8, 8, 2)


# ---- nonzero_box ---------------------------------------------------------------------------------------


def test_nonzero_box_unites_the_channels():
    image = np.zeros((6, 6, 6, 2), np.float32)
    image[1, 1, 1, 0] = 1.0
    image[4, 2, 5, 1] = -3.0
    assert nonzero_box(image) == (4, 2, 5)


def test_nonzero_box_of_an_empty_image_is_the_whole_shape():
    assert nonzero_box(np.zeros((3, 4, 5), np.float32)) == (3, 4, 5)


def test_the_docstring_example_holds():
    fp = Fingerprint(("a", "b"), ((1.0, 1.0, 1.0),) * 2, ((160, 192, 160), (150, 190, 150)), False, False)
    assert fp.total_voxels == 9_190_200
