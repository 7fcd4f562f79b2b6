"""bigmem.data.preprocess: one normalisation for every path, chosen from the dataset, stored compactly."""

from __future__ import annotations

import numpy as np
import pytest

from bigmem.data.pipeline import load_patch, normalized
from bigmem.data.preprocess import (
    ChannelScheme,
    Preprocessing,
    case_statistics,
    choose_schemes,
    FOREGROUND_SAMPLES_PER_CASE,
    foreground_sample,
    is_ct,
    storage_dtype,
)
from bigmem.data.store import HDF5VolumeStore, StoreWriter
from bigmem.data.transforms import Sample, ScaleShift
from bigmem.errors import DataError


def _mri(rng, shape=(20, 18, 16), channels=2):
    """A skull-stripped-looking case: zero outside an inner box, tissue inside."""
    image = np.zeros((*shape, channels), np.float32)
    image[4:-4, 4:-4, 3:-3] = rng.normal(300, 50, (shape[0] - 8, shape[1] - 8, shape[2] - 6, channels))
    return image


def test_statistics_and_each_scheme():
    rng = np.random.default_rng(0)
    image = _mri(rng)
    stats = case_statistics(image)
    flat = image.reshape(-1, 2).astype(np.float64)
    inside = flat[np.any(flat != 0, axis=1)]
    assert stats["mean"] == pytest.approx(flat.mean(0))
    assert stats["std"] == pytest.approx(flat.std(0))
    assert stats["nonzero_mean"] == pytest.approx(inside.mean(0))
    assert stats["min"] == [0.0, 0.0]
    assert stats["nonzero_box"] == pytest.approx((12 / 20) * (10 / 18) * (10 / 16))
    z = Preprocessing((ChannelScheme("zscore"),) * 2).normalize(image.copy(), stats)
    assert z.reshape(-1, 2).mean(0) == pytest.approx([0, 0], abs=1e-5)
    assert z.reshape(-1, 2).std(0) == pytest.approx([1, 1], abs=1e-4)
    nz = Preprocessing((ChannelScheme("zscore_nonzero"),) * 2)
    masked = nz.normalize(image.copy(), stats)
    assert np.all(masked[image == 0] == 0)
    assert masked[image != 0].reshape(-1, 2).mean(0) == pytest.approx([0, 0], abs=1e-4)
    assert list(nz.background(stats)) == [0.0, 0.0]
    ct = Preprocessing((ChannelScheme("ct", -50.0, 250.0, 100.0, 50.0), ChannelScheme("none")))
    out = ct.normalize(np.array([[[[-1000.0, 7.0], [100.0, 8.0], [900.0, 9.0]]]], np.float32), stats)
    np.testing.assert_allclose(out[..., 0], [[[-3.0, 0.0, 3.0]]], atol=1e-6)  # clipped, then (x - 100) / 50
    np.testing.assert_array_equal(out[..., 1], [[[7.0, 8.0, 9.0]]])  # none: as stored


def test_the_nonzero_mask_is_the_images_before_any_channel_changes():
    """A z-scored channel before a zscore_nonzero one must not move the mask (its zeros become nonzero)."""
    rng = np.random.default_rng(5)
    image = _mri(rng)
    stats = case_statistics(image)
    mixed = Preprocessing((ChannelScheme("zscore"), ChannelScheme("zscore_nonzero"))).normalize(image.copy(), stats)
    outside = ~np.any(image != 0, axis=-1)
    assert np.all(mixed[..., 1][outside] == 0)
    assert np.count_nonzero(mixed[..., 0][outside]) == outside.sum()


def test_a_patch_gets_the_values_of_the_same_voxels_in_the_whole_case(tmp_path):
    """The statistics are the case's, so patches (compare's baseline) match whole volumes and windows."""
    rng = np.random.default_rng(1)
    path = tmp_path / "s.h5"
    with StoreWriter(path, num_classes=2, channel_names=["T1", "T2"]) as writer:
        for index in range(2):
            image = _mri(rng)
            writer.add_case(f"c{index}", image, (image[..., 0] > 300).astype(np.uint8))
        writer.set_root_attr("preprocessing", Preprocessing((ChannelScheme("zscore_nonzero"),
                                                              ChannelScheme("zscore"))).to_json())
        writer.commit()
    with HDF5VolumeStore(path) as store:
        image, _ = store.read_case("c1")
        whole, background = normalized(store, "c1", image.copy())
        region = (slice(2, 14), slice(5, 17), slice(0, 9))
        patch, _ = store.read_patch("c1", (2, 5, 0), (12, 12, 9))
        np.testing.assert_array_equal(normalized(store, "c1", patch, whole=False)[0], whole[region])
        assert background[1] == pytest.approx(float(whole[..., 1].min()))  # padding at the darkest voxel
        assert background[0] == 0.0  # outside the nonzero mask
        for sample in range(4):  # load_patch gives the same values where the patch is inside the case
            patch_image, _ = load_patch(store, sample, patch=8, seed=3)
            assert patch_image.shape == (8, 8, 8, 2)
            assert np.isfinite(patch_image).all()


def test_choose_schemes_as_nnunet():
    rng = np.random.default_rng(2)
    cases = [_mri(rng, channels=1) for _ in range(3)]
    stats = [case_statistics(c) for c in cases]
    samples = [foreground_sample(c, (c[..., 0] > 0).astype(np.uint8), count=50) for c in cases]
    assert all(len(s) == 50 for s in samples)
    assert choose_schemes(["FLAIR"], stats, samples).channels[0].scheme == "zscore_nonzero"  # box 35% of a case
    full = [case_statistics(rng.normal(0, 1, (8, 8, 8, 1)).astype(np.float32)) for _ in range(3)]
    assert choose_schemes(["T1w"], full, samples).channels[0].scheme == "zscore"
    ct = choose_schemes(["CT"], stats, samples).channels[0]
    pooled = np.concatenate(samples)[:, 0]
    assert ct.scheme == "ct"
    assert ct.low == pytest.approx(np.percentile(pooled, 0.5))
    assert ct.mean == pytest.approx(pooled.mean())
    assert ct.std == pytest.approx(pooled.std())
    assert choose_schemes(["CT"], stats, samples, "zscore").channels[0].scheme == "zscore"
    with pytest.raises(DataError, match=r"Channel 'CT': CT normalisation needs the dataset's foreground voxels"):
        choose_schemes(["CT"], stats, [np.zeros((0, 1), np.float32)] * 3)
    assert [is_ct(n) for n in ("CT", "ct_venous", "Tract", "T2w", "PET/CT")] == [True, True, False, False, True]


def test_ct_statistics_weigh_every_case_the_same():
    """nnU-Net's fingerprint draws as many foreground voxels from each case: a case with a small foreground
    weighs as much as one with a large one. By hand: the equal-weight mean is the mean of the case means,
    the variance the mean of the cases' second moments less the squared mean."""
    rng = np.random.default_rng(5)
    small = rng.normal(100.0, 10.0, (4, 5, 5, 1)).astype(np.float32)  # 100 foreground voxels around 100 HU
    large = rng.normal(300.0, 30.0, (20, 20, 20, 1)).astype(np.float32)  # 8000 around 300 HU
    samples = [foreground_sample(case, np.ones(case.shape[:3], np.uint8)) for case in (small, large)]
    assert [len(s) for s in samples] == [FOREGROUND_SAMPLES_PER_CASE] * 2
    ct = choose_schemes(["CT"], [case_statistics(c) for c in (small, large)], samples).channels[0]
    means = [float(small.mean()), float(large.mean())]
    second = [float((small.astype(np.float64) ** 2).mean()), float((large.astype(np.float64) ** 2).mean())]
    by_hand_mean = sum(means) / 2
    by_hand_std = (sum(second) / 2 - by_hand_mean ** 2) ** 0.5
    assert ct.mean == pytest.approx(by_hand_mean, rel=1e-3)  # ~200: each case half; pooled voxels would give ~298
    assert ct.std == pytest.approx(by_hand_std, rel=1e-3)
    # the 99.5th percentile of the equal-weight mixture: within the large case (its top 1% of values)
    assert ct.high == pytest.approx(float(np.percentile(large, 99.0)), rel=2e-3)


def test_foreground_sample_of_a_case_without_foreground_is_empty():
    assert foreground_sample(np.ones((4, 4, 4, 2), np.float32), np.zeros((4, 4, 4), np.uint8)).shape == (0, 2)


def test_storage_dtype_keeps_what_normalisation_uses():
    rng = np.random.default_rng(3)
    hu = np.round(rng.normal(0, 400, (8, 8, 8, 1))).astype(np.float32)
    assert storage_dtype(hu, case_statistics(hu)) == np.int16
    mri = rng.normal(300, 50, (8, 8, 8, 1)).astype(np.float32)
    assert storage_dtype(mri, case_statistics(mri)) == np.float16
    wide = mri * 1000
    assert storage_dtype(wide, case_statistics(wide)) == np.float32  # past float16's range
    flat = (1000 + rng.normal(0, 1e-3, (8, 8, 8, 1))).astype(np.float32)
    assert storage_dtype(flat, case_statistics(flat)) == np.float32  # rounding would move voxels by ~0.5 std
    with pytest.raises(DataError, match="non-finite"):
        case_statistics(np.full((2, 2, 2, 1), np.nan, np.float32))


def test_records_are_checked():
    record = Preprocessing((ChannelScheme("ct", -1.0, 1.0, 0.0, 1.0),)).to_json()
    assert Preprocessing.from_json(record, 1).channels[0].high == 1.0
    assert Preprocessing.from_json(None, 2) == Preprocessing.default(2)
    with pytest.raises(DataError, match=r"s\.h5: its preprocessing names 1 channel; the data has 2\."):
        Preprocessing.from_json(record, 2, "s.h5")
    with pytest.raises(DataError, match=r"channel 0's normalisation 'minmax' is not one of ct, zscore"):
        Preprocessing.from_json('{"channels": [{"scheme": "minmax"}]}', 1, "s.h5")
    with pytest.raises(DataError, match=r"channel 0 is normalised as CT but its clip window"):
        Preprocessing.from_json('{"channels": [{"scheme": "ct"}]}', 1, "s.h5")


def test_intensity_augmentation_moves_the_background_with_the_channel():
    rng = np.random.default_rng(4)
    image = rng.normal(0, 1, (6, 6, 6, 2)).astype(np.float32)
    before = image.copy()
    sample = Sample(image, np.zeros((6, 6, 6), np.uint8), np.array([-2.0, -1.0], np.float32))
    background = ScaleShift(scale=0.1, shift=0.1).apply(sample, np.random.default_rng(9)).background
    draw = np.random.default_rng(9)
    for c in range(2):
        factor, offset = draw.uniform(0.9, 1.1), draw.uniform(-0.1, 0.1)
        np.testing.assert_allclose(image[..., c], before[..., c] * np.float32(factor) + np.float32(offset), rtol=1e-6)
        assert background[c] == pytest.approx([-2.0, -1.0][c] * factor + offset, rel=1e-6)
