"""The augmentation transforms: each one's rule, the chain's streams, and nnU-Net's parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bigmem.data.transforms import (
    PAD_LABEL,
    Brightness,
    Compose,
    Contrast,
    Gamma,
    GaussianBlur,
    GaussianNoise,
    InvertedGamma,
    LowResolution,
    Mirror,
    Sample,
    ScaleShift,
    SpatialTransform,
    affine_resample,
    background_contrast,
    chain,
    stream,
    thin_axis,
)
from bigmem.errors import ConfigError


def _sample(shape=(9, 11, 13), channels=2, seed=0) -> Sample:
    rng = np.random.default_rng(seed)
    image = rng.normal(0, 1, (*shape, channels)).astype(np.float32)
    label = rng.integers(0, 3, shape).astype(np.uint8)
    return Sample(image, label, np.full(channels, -3.0, np.float32))


def _copy(sample: Sample) -> Sample:
    return Sample(sample.image.copy(), sample.label.copy(), sample.background.copy())


@pytest.mark.parametrize("shape", [(33, 33, 33), (35, 35, 35)])
def test_quarter_turn_equals_rot90(shape):
    """A 90 degree rotation about the centre of an odd-sized cube lands on the grid: resampling is exact."""
    sample = _sample(shape)
    turn = np.array([[1.0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]])  # out[d, h, w] = in[d, n - 1 - w, h]
    out = affine_resample(_copy(sample), turn)
    expected_label = np.rot90(sample.label, k=-1, axes=(1, 2))
    expected_image = np.rot90(sample.image, k=-1, axes=(1, 2))
    assert np.array_equal(out.label, expected_label)
    np.testing.assert_allclose(out.image, expected_image, atol=1e-5)


def test_flip_only_matrix_is_an_exact_flip():
    sample = _sample()
    out = affine_resample(_copy(sample), np.diag([-1.0, 1.0, -1.0]))
    assert np.array_equal(out.image, np.flip(sample.image, (0, 2)))
    assert np.array_equal(out.label, np.flip(sample.label, (0, 2)))


def test_identity_matrix_returns_the_sample_unchanged():
    sample = _sample()
    assert affine_resample(sample, np.eye(3)) is sample


def test_what_comes_from_outside_is_background_and_pad_label():
    sample = _sample((16, 16, 16), channels=1)
    sample.label[...] = 1
    out = affine_resample(_copy(sample), np.eye(3) * 1.4)  # samples a region 1.4x the volume: its rim is outside
    assert out.label.shape == (16, 16, 16)
    assert out.label[0, 0, 0] == PAD_LABEL
    assert out.image[0, 0, 0, 0] == pytest.approx(-3.0)
    assert out.label[8, 8, 8] == 1
    assert set(np.unique(out.label)) == {1, PAD_LABEL}


def test_label_takes_the_value_whose_interpolated_mask_is_largest():
    """nnU-Net's rule: each label's mask interpolated linearly and the largest wins. A thin structure keeps
    its interpolated outline: a one-plane label 1 read at 0.25 and 0.75 of a voxel from it (zooming D by 2)
    is 1 where its mask interpolates to 0.75 and 0 where to 0.25."""
    sample = Sample(np.zeros((9, 3, 3, 1), np.float32), np.zeros((9, 3, 3), np.uint8), np.zeros(1, np.float32))
    sample.label[4] = 1
    out = affine_resample(sample, np.diag([0.5, 1.0, 1.0]))  # output plane p reads input 4 + (p - 4) / 2
    assert out.label[4, 1, 1] == 1  # reads 4.0
    assert out.label[5, 1, 1] == 0  # reads 4.5: a tie, settled by the nearest neighbour (plane 5: label 0)
    assert out.label[3, 1, 1] == 1  # reads 3.5: a tie, nearest neighbour rounds up to plane 4 (label 1)


def test_a_tie_goes_to_the_nearest_neighbours_label():
    """batchgeneratorsv2 0.3.6 (seg_tiebreak='nearest'): where two labels share the top interpolated score,
    the nearest neighbour's label wins, whichever value is lower."""
    sample = Sample(np.zeros((9, 3, 3, 1), np.float32), np.ones((9, 3, 3), np.uint8), np.zeros(1, np.float32))
    sample.label[5:] = 2  # 1 below plane 5, 2 from it
    out = affine_resample(sample, np.diag([0.5, 1.0, 1.0]))
    assert out.label[5, 1, 1] == 2  # reads 4.5: 1 and 2 tie at 0.5; the nearest neighbour is plane 5 (label 2)
    assert out.label[4, 1, 1] == 1


def test_scaling_above_one_makes_the_anatomy_smaller():
    sample = _sample((24, 24, 24), channels=1)
    sample.label[...] = 0
    sample.label[6:18, 6:18, 6:18] = 1
    transform = SpatialTransform(p_rotation=0.0, p_scaling=1.0, scaling=(1.3, 1.3), mirror_axes=())
    out = transform(_copy(sample), np.random.default_rng(0))
    assert (out.label == 1).sum() < (sample.label == 1).sum()


def test_spatial_matrix_on_an_anisotropic_volume_rotates_only_about_the_thin_axis():
    transform = SpatialTransform(p_rotation=1.0, p_scaling=1.0, mirror_axes=(), dummy_2d_axis=thin_axis((64, 64, 12)))
    matrix = transform.matrix(np.random.default_rng(3))
    assert transform.dummy_2d_axis == 2
    np.testing.assert_allclose(matrix[2], [0.0, 0.0, 1.0])  # the thin axis neither rotates nor scales
    np.testing.assert_allclose(matrix[:, 2], [0.0, 0.0, 1.0])
    assert not np.allclose(matrix[:2, :2], np.eye(2))


def test_thin_axis_follows_nnunets_threshold_of_three():
    assert thin_axis((60, 60, 21)) is None  # 2.86
    assert thin_axis((63, 63, 21)) is None  # exactly 3: not more than 3
    assert thin_axis((64, 64, 21)) == 2  # 3.05


def test_background_contrast_draws_below_and_above_one_equally():
    rng = np.random.default_rng(0)
    draws = np.array([background_contrast(rng, 0.75, 1.25) for _ in range(4000)])
    assert draws.min() >= 0.75
    assert draws.max() <= 1.25
    assert abs((draws < 1).mean() - 0.5) < 0.03


def test_noise_standard_deviation_is_the_drawn_variance_as_batchgeneratorsv2_uses_it():
    sample = Sample(np.zeros((32, 32, 32, 1), np.float32), np.zeros((32, 32, 32), np.uint8), np.zeros(1, np.float32))
    rng = np.random.default_rng(4)
    expected = np.random.default_rng(4).uniform(0.0, 0.1)
    out = GaussianNoise(probability=1.0).apply(sample, rng)
    assert float(out.image.std()) == pytest.approx(expected, rel=0.02)


def test_brightness_maps_the_background_with_the_channel():
    sample = _sample()
    before = sample.image.copy()
    out = Brightness(probability=1.0).apply(sample, np.random.default_rng(5))
    factor = out.image[..., 0] / before[..., 0]
    np.testing.assert_allclose(factor, factor.flat[0], rtol=1e-5)
    assert out.background[0] == pytest.approx(-3.0 * factor.flat[0], rel=1e-5)


def test_contrast_keeps_the_channel_range():
    sample = _sample()
    low, high = sample.image[..., 1].min(), sample.image[..., 1].max()
    mean = float(sample.image[..., 1].mean(dtype=np.float64))
    out = Contrast(probability=1.0, factor=(1.25, 1.25)).apply(sample, np.random.default_rng(6))
    assert out.image[..., 1].min() >= low
    assert out.image[..., 1].max() <= high
    assert out.background[1] == pytest.approx(max((-3.0 - mean) * 1.25 + mean, low), rel=1e-5)


@pytest.mark.parametrize("transform", [Gamma(probability=1.0), InvertedGamma(probability=1.0)])
def test_gamma_retains_mean_and_standard_deviation(transform):
    sample = _sample((10, 10, 10), channels=1)
    mean, std = float(sample.image.mean()), float(sample.image.std(ddof=1))
    out = transform.apply(sample, np.random.default_rng(7))
    assert float(out.image.mean()) == pytest.approx(mean, abs=1e-5)
    assert float(out.image.std(ddof=1)) == pytest.approx(std, rel=1e-4)


def test_gamma_of_one_changes_nothing():
    sample = _sample((6, 6, 6), channels=1)
    before = sample.image.copy()
    out = Gamma(probability=1.0, gamma=(1.0, 1.0)).apply(sample, np.random.default_rng(0))
    np.testing.assert_allclose(out.image, before, atol=1e-5)


def test_low_resolution_at_factor_one_is_the_identity():
    sample = _sample((12, 14, 16), channels=1)
    before = sample.image.copy()
    out = LowResolution(probability=1.0, scale=(1.0, 1.0), p_per_channel=1.0).apply(sample, np.random.default_rng(0))
    np.testing.assert_allclose(out.image, before, atol=1e-6)


def test_low_resolution_at_half_is_smoother():
    sample = _sample((16, 16, 16), channels=1)
    roughness = float(np.abs(np.diff(sample.image[..., 0], axis=0)).mean())
    out = LowResolution(probability=1.0, scale=(0.5, 0.5), p_per_channel=1.0).apply(sample, np.random.default_rng(0))
    assert out.image.shape == (16, 16, 16, 1)
    assert float(np.abs(np.diff(out.image[..., 0], axis=0)).mean()) < 0.7 * roughness


def test_blur_is_smoother_and_keeps_the_mean():
    sample = _sample((16, 16, 16), channels=1)
    mean = float(sample.image.mean())
    out = GaussianBlur(probability=1.0, p_per_channel=1.0).apply(sample, np.random.default_rng(1))
    assert float(out.image.std()) < 0.8
    assert float(out.image.mean()) == pytest.approx(mean, abs=0.02)


def test_scale_shift_draws_factor_then_offset():
    sample = _sample((4, 4, 4), channels=1)
    before = sample.image.copy()
    out = ScaleShift(scale=0.2, shift=0.5).apply(sample, np.random.default_rng(2))
    draw = np.random.default_rng(2)
    factor, offset = np.float32(draw.uniform(0.8, 1.2)), np.float32(draw.uniform(-0.5, 0.5))
    np.testing.assert_allclose(out.image, before * factor + offset, rtol=1e-6)


def test_a_transform_below_its_probability_is_skipped():
    sample = _sample()
    assert GaussianNoise(probability=0.0)(sample, np.random.default_rng(0)) is sample


def test_compose_draws_are_a_function_of_seed_sample_and_name():
    nnunet = chain("nnunet")
    first = nnunet(_sample(), seed=3, sample_index=11)
    again = nnunet(_sample(), seed=3, sample_index=11)
    other = nnunet(_sample(), seed=3, sample_index=12)
    assert np.array_equal(first.image, again.image)
    assert np.array_equal(first.label, again.label)
    assert not np.array_equal(first.image, other.image)


def test_adding_a_transform_keeps_the_others_draws():
    noise = GaussianNoise(probability=1.0)
    alone = Compose([noise])(_sample(), seed=1, sample_index=2)
    after_mirror = Compose([Brightness(probability=0.0), noise])(_sample(), seed=1, sample_index=2)
    assert np.array_equal(alone.image, after_mirror.image)


def test_stream_differs_per_transform_name():
    assert stream(0, 1, "noise").random() != stream(0, 1, "blur").random()


def test_compose_refuses_repeated_names():
    with pytest.raises(ValueError, match="transform names repeat"):
        Compose([Gamma(), Gamma()])


def test_nnunet_chain_has_nnunets_order_probabilities_and_ranges():
    """nnUNetTrainer.get_training_transforms (nnU-Net v2.8.1) with batchgeneratorsv2 0.3.5."""
    transforms = chain("nnunet").to_dict()["transforms"]
    assert [t["name"] for t in transforms] == ["spatial", "noise", "blur", "brightness", "contrast", "lowres",
                                               "gamma_inverted", "gamma"]
    spatial, noise, blur, brightness, contrast, lowres, inverted, gamma = transforms
    assert (spatial["p_rotation"], spatial["rotation_deg"], spatial["rotation_2d_deg"]) == (0.2, 30.0, 180.0)
    assert (spatial["p_scaling"], spatial["scaling"], spatial["mirror_axes"]) == (0.2, [0.7, 1.4], [0, 1, 2])
    assert (noise["probability"], noise["variance"]) == (0.1, [0.0, 0.1])
    assert (blur["probability"], blur["sigma"], blur["p_per_channel"]) == (0.2, [0.5, 1.0], 0.5)
    assert (brightness["probability"], brightness["multiplier"]) == (0.15, [0.75, 1.25])
    assert (contrast["probability"], contrast["factor"], contrast["preserve_range"]) == (0.15, [0.75, 1.25], True)
    assert (lowres["probability"], lowres["scale"], lowres["p_per_channel"]) == (0.25, [0.5, 1.0], 0.5)
    assert (inverted["probability"], inverted["gamma"], inverted["invert"]) == (0.1, [0.7, 1.5], True)
    assert (gamma["probability"], gamma["gamma"], gamma["invert"], gamma["retain_stats"]) == (0.3, [0.7, 1.5],
                                                                                                False, True)


def test_light_chain_is_mirroring_and_scale_shift():
    assert [t.name for t in chain("light").transforms] == ["mirror", "scale_shift"]
    assert [t.name for t in chain("light", flip=False, intensity=(0.0, 0.0)).transforms] == []
    assert isinstance(chain("light").transforms[0], Mirror)


def test_none_chain_is_empty_and_false():
    assert not chain("none")


def test_unknown_chain_names_the_setting_and_the_choices():
    with pytest.raises(ConfigError, match=r"Invalid data.augment 'nnunte': expected one of nnunet, spatial, "
                                          r"intensity, light, none"):
        chain("nnunte")


def test_working_bytes_is_the_worst_transform():
    shape, channels = (10, 10, 10), 4
    expected = math.ceil((1.3 * channels + 3.1) * 1000 * 4)  # the spatial transform's, as measured
    assert chain("nnunet").working_bytes(shape, channels) == expected
    assert chain("none").working_bytes(shape, channels) == 0


def test_sample_repr_says_its_memory():
    assert "memory: " in repr(_sample())


def _per_label_reference(label, matrix, offset):
    """The rule as written: every label's mask resampled over the whole grid, largest wins, ties to the
    nearest neighbour, PAD_LABEL outside (the slow form ``resample_label`` must equal)."""
    from scipy import ndimage

    shape = label.shape
    out = np.full(shape, PAD_LABEL, np.uint8)
    best = np.zeros(shape, np.float32)
    nearest = ndimage.affine_transform(label, matrix, offset, output=np.uint8, order=0, mode="constant",
                                       cval=PAD_LABEL, prefilter=False)
    nearest_score = np.full(shape, -1.0, np.float32)
    for value in np.unique(label):
        score = ndimage.affine_transform((label == value).astype(np.float32), matrix, offset, output=np.float32,
                                         order=1, mode="constant", cval=0.0, prefilter=False)
        out[score > best] = value
        best = np.maximum(best, score)
        nearest_score[nearest == value] = score[nearest == value]
    tied = (nearest_score == best) & (best > 0)
    out[tied] = nearest[tied]
    return out


@pytest.mark.parametrize("shape", [(33, 34, 35), (20, 41, 9)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resample_label_equals_the_per_label_rule(shape, seed):
    from scipy import ndimage

    from bigmem.data.transforms import resample_label

    rng = np.random.default_rng(seed)
    smooth = ndimage.gaussian_filter(rng.normal(size=shape), 2.0)
    label = np.digitize(smooth, np.quantile(smooth, [0.4, 0.7, 0.9])).astype(np.uint8)  # blobs 0..3
    label[:2] = PAD_LABEL if seed == 2 else label[:2]  # padding in the input, as in a patch
    transform = SpatialTransform(p_rotation=1.0, p_scaling=1.0, rotation_deg=40.0)
    matrix = transform.matrix(rng)
    centre = (np.asarray(shape, np.float64) - 1) / 2
    offset = centre - matrix @ centre
    expected = _per_label_reference(label, matrix, offset)
    got = resample_label(label, matrix, offset)
    assert np.array_equal(got, expected)
    assert (got == PAD_LABEL).any()  # the rotation brought in voxels from outside


def test_resample_label_interpolates_only_mixed_cells(monkeypatch):
    """Off boundaries the nearest neighbour is the answer: a uniform label needs no per-label pass."""
    from scipy import ndimage

    from bigmem.data.transforms import resample_label

    calls = []
    original = ndimage.map_coordinates
    monkeypatch.setattr(ndimage, "map_coordinates", lambda *a, **k: calls.append(1) or original(*a, **k))
    label = np.ones((16, 16, 16), np.uint8)
    matrix = np.diag([0.5, 0.5, 0.5])  # a zoom in: every sample point inside the volume
    centre = np.full(3, 7.5)
    out = resample_label(label, matrix, centre - matrix @ centre)
    assert calls == []
    assert (out == 1).all()


@pytest.mark.parametrize("shape, dummy, expected", [
    ((64, 64, 64), None, (102, 102, 102)),  # get_patch_size((64,) * 3, 30 degrees, (0.85, 1.25)): [102 102 102]
    ((40, 96, 80), None, (98, 144, 106)),  # nnU-Net: [97 144 105]; odd growths rounded up to even
    ((20, 128, 96), 0, (20, 150, 150)),  # dummy 2D: nnU-Net's [150 150 150] with the thin axis kept
])
def test_margin_shape_is_nnunets_initial_patch_size(shape, dummy, expected):
    """The values nnunetv2 2.8.1's get_patch_size returns for these patches (its rotation at most 90 degrees)."""
    from bigmem.data.transforms import margin_shape

    assert margin_shape(shape, rotation_deg=30, rotation_2d_deg=180, dummy_2d_axis=dummy) == expected


def test_thin_axis_is_the_coarsest_spacing_where_one_is_coarser():
    assert thin_axis((64, 200, 200), (5.0, 0.8, 0.8)) == 0
    assert thin_axis((200, 64, 200), (0.8, 0.8, 0.8)) == 1  # no spacing differs: the shortest edge
    assert thin_axis((100, 200, 200), (5.0, 0.8, 0.8)) is None  # 2x: not more than 3x


def test_a_spatial_transform_into_a_window_of_an_identity_draw_is_the_window():
    from dataclasses import replace

    sample = _sample((12, 14, 16), channels=1)
    windowed = replace(_copy(sample), window=((2, 3, 4), (8, 8, 8)))
    out = affine_resample(windowed, np.eye(3))
    assert np.array_equal(out.label, sample.label[2:10, 3:11, 4:12])


def test_chains_of_nnunets_parts():
    assert [t.name for t in chain("spatial").transforms] == ["spatial"]
    assert [t.name for t in chain("intensity").transforms] == ["noise", "blur", "brightness", "contrast", "lowres",
                                                               "gamma_inverted", "gamma"]


def test_dummy_2d_is_decided_once_from_the_planned_shape():
    spatial = chain("nnunet", planned_shape=(20, 128, 128)).transforms[0]
    assert spatial.dummy_2d_axis == 0


def test_working_bytes_of_a_crop_count_its_margin():
    nnunet = chain("nnunet")
    whole = nnunet.working_bytes((64, 64, 64), 1)
    assert nnunet.working_bytes((64, 64, 64), 1, cropped=True) - whole == (102**3 - 64**3) * 5
