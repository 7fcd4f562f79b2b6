"""bigmem.infer.sliding: Gaussian weights, window positions (odd sizes) and the blended result."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bigmem.errors import DataError, UsageError
from bigmem.infer.sliding import (
    AccumulationOverflowError,
    InferenceError,
    gaussian_weights,
    sliding_window,
    window_starts,
)

# ---- weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [5, 16, 17, (8, 12, 9)])
def test_gaussian_weights_shape_max_symmetry_positive(window):
    weights = gaussian_weights(window)
    shape = (window,) * 3 if isinstance(window, int) else window
    assert weights.shape == shape
    assert weights.dtype == np.float32
    assert weights.max() == 1.0
    assert np.all(weights > 0)
    for axis in range(3):
        assert np.array_equal(weights, np.flip(weights, axis))
    assert np.unravel_index(weights.argmax(), shape) == tuple((s - 1) // 2 for s in shape)


def test_gaussian_weights_values():
    # window 5, sigma 5/8: profile exp(-x^2 / (2 * 0.625^2)) at x = -2..2; the corner (2.1e-7) floors to 1e-3.
    weights = gaussian_weights(5)
    assert weights[2, 2, 2] == 1.0
    assert weights[2, 2, 1] == pytest.approx(math.exp(-1 / 0.78125), rel=1e-6)
    assert weights[2, 1, 1] == pytest.approx(math.exp(-2 / 0.78125), rel=1e-6)
    assert weights[0, 0, 0] == pytest.approx(1e-3, rel=1e-6)
    # An even window's unscaled maximum (its four centre voxels) is below 1: MONAI's floor, applied
    # before the scaling, ends up a little above 1e-3.
    even = gaussian_weights(16)
    centre_max = math.exp(-(0.5 ** 2) / (2 * 2.0 ** 2)) ** 3
    assert even.min() == pytest.approx(1e-3 / centre_max, rel=1e-6)


def test_gaussian_weights_underflow_gets_the_smallest_positive_weight():
    # sigma 0.32 voxels: most of the window underflows float32 (and the corners float64) to 0.
    raw = gaussian_weights(64, sigma_scale=0.005, min_weight=0)
    assert np.all(raw > 0)
    assert raw.max() == 1.0
    profile = np.exp(-((np.arange(64) - 31.5) ** 2) / (2 * 0.32 ** 2))
    full = profile[:, None, None] * profile[None, :, None] * profile[None, None, :]
    scaled = (full / full.max()).astype(np.float32)
    assert np.count_nonzero(scaled == 0) > 0.9 * scaled.size  # the case this guards
    assert raw.min() == scaled[scaled > 0].min()
    assert np.array_equal(raw[scaled > 0], scaled[scaled > 0])


def test_gaussian_weights_errors():
    with pytest.raises(UsageError, match=r"Invalid window 0: expected a positive size in voxels"):
        gaussian_weights(0)
    with pytest.raises(UsageError, match=r"Invalid sigma_scale 0: expected a positive fraction"):
        gaussian_weights(8, sigma_scale=0)


# ---- window positions -----------------------------------------------------------------------------


def _monai_starts(size: int, window: int, overlap: float) -> list[int]:
    """MONAI's placement, written as its loop: step int(w * (1 - overlap)) (w itself when w == size),
    windows until one reaches the end, each start pulled back inside."""
    size = max(size, window)
    step = window if window == size else max(1, int(window * (1 - overlap)))
    count = next(d for d in range(math.ceil(size / step)) if d * step + window >= size) + 1
    return [d * step - max(d * step + window - size, 0) for d in range(count)]


@pytest.mark.parametrize("size", [33, 34, 35, 10, 16, 17])
@pytest.mark.parametrize("window, overlap", [(16, 0.5), (16, 0.25), (16, 0.0), (15, 0.6), (8, 0.9)])
def test_window_starts_cover_every_voxel_in_bounds(size, window, overlap):
    starts = window_starts(size, window, overlap)
    padded = max(size, window)
    assert starts[0] == 0
    assert starts[-1] == padded - window
    assert starts == sorted(set(starts))
    covered = np.zeros(padded, bool)
    for start in starts:
        assert 0 <= start
        assert start + window <= padded
        covered[start:start + window] = True
    assert covered.all()
    assert starts == _monai_starts(size, window, overlap)


@pytest.mark.parametrize("size, window, overlap, expected", [
    (33, 16, 0.5, [0, 8, 16, 17]), (34, 16, 0.5, [0, 8, 16, 18]), (35, 16, 0.5, [0, 8, 16, 19]),
    (10, 16, 0.5, [0]), (35, 16, 0.25, [0, 12, 19]), (128, 128, 0.5, [0]),
])
def test_window_starts_values(size, window, overlap, expected):
    assert window_starts(size, window, overlap) == expected


def test_window_starts_errors():
    with pytest.raises(UsageError, match=r"Invalid overlap 1: expected a fraction in \[0, 1\)"):
        window_starts(33, 16, 1)
    with pytest.raises(UsageError, match=r"Invalid window 0 for an axis of 33 voxels"):
        window_starts(33, 0, 0.5)


# ---- the blended result -----------------------------------------------------------------------------

SHAPES = [(33, 34, 35), (10, 20, 12)]  # odd sizes; an axis (or two) smaller than the window


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_constant_predictor_gives_the_constant(shape, batch_size):
    image = np.random.default_rng(0).normal(size=shape + (2,)).astype(np.float32)
    constant = np.array([0.2, 0.7, 0.1], np.float32)
    calls, seen = [], []

    def predict(batch):
        calls.append(batch.shape)
        return np.broadcast_to(constant, batch.shape[:4] + (3,)).copy()

    out = sliding_window(image, predict, 16, num_classes=3, batch_size=batch_size,
                         progress=lambda done, total: seen.append((done, total)))
    assert out.shape == shape + (3,)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.broadcast_to(constant, out.shape), rtol=3e-6)  # a few float32 ulps
    total = math.prod(len(window_starts(s, 16, 0.5)) for s in shape)
    assert seen[-1] == (total, total)
    assert len(calls) == math.ceil(total / batch_size)
    assert all(c[1:] == (16, 16, 16, 2) for c in calls)


@pytest.mark.parametrize("shape", SHAPES)
# float16: each sum keeps 11 significant bits; a voxel reached only by many windows' 1e-3 tails
# (27 of them at 33 x 34 x 35) collects the rounding of every small addition: up to ~0.01.
@pytest.mark.parametrize("accumulate, atol, mean_atol", [("float32", 3e-6, 1e-7), ("float16", 1.5e-2, 5e-4)])
def test_identity_predictor_reproduces_the_input(shape, accumulate, atol, mean_atol):
    """Class 1 is the input's channel 0: any misplaced window shows up as a mismatch."""
    image = np.random.default_rng(1).random(shape + (1,)).astype(np.float32)

    def predict(batch):
        return np.concatenate([1 - batch, batch], axis=-1)

    out = sliding_window(image, predict, (16, 15, 17), num_classes=2, accumulate=accumulate, batch_size=2)
    assert out.shape == shape + (2,)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[..., 1], image[..., 0], atol=atol)
    assert np.abs(out[..., 1] - image[..., 0]).mean() < mean_atol
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=atol)


def test_overlaps_blend_with_the_gaussian_weights():
    """Two windows along D (starts 0 and 8) predicting 0 and 1: the overlap reads w8 / (w0 + w8)."""
    image = np.zeros((24, 16, 16, 1), np.float32)
    predictions = iter([0.0, 1.0])

    def predict(batch):
        return np.full(batch.shape[:4] + (1,), next(predictions), np.float32)

    out = sliding_window(image, predict, 16, num_classes=1, overlap=0.5)[:, 5, 9, 0]
    profile = gaussian_weights(16)[:, 5, 9].astype(np.float64)  # the other axes' factors cancel
    first = np.concatenate([profile, np.zeros(8)])
    second = np.concatenate([np.zeros(8), profile])
    np.testing.assert_allclose(out, second / (first + second), rtol=1e-6)
    assert np.all(out[:8] == 0.0)
    assert np.all(out[16:] == 1.0)
    assert np.all(np.diff(out[7:17]) > 0)


def test_float16_accumulation_close_to_float32():
    rng = np.random.default_rng(2)
    image = rng.normal(size=(35, 33, 34, 1)).astype(np.float32)

    def predict(batch):  # softmax over 4 classes of fixed functions of the input
        logits = np.concatenate([batch, -batch, 0.5 * batch ** 2, np.zeros_like(batch)], axis=-1)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    full = sliding_window(image, predict, 16, num_classes=4, accumulate="float32")
    half = sliding_window(image, predict, 16, num_classes=4, accumulate="float16")
    assert half.dtype == np.float32
    np.testing.assert_allclose(half, full, atol=1e-2)
    assert np.abs(half - full).mean() < 5e-4
    assert np.mean(half.argmax(-1) == full.argmax(-1)) > 0.999
    assert np.abs(half - full).max() > 1e-5  # it really accumulated in float16


def test_float16_overflow_is_a_clear_error():
    image = np.zeros((24, 16, 16, 1), np.float32)

    def predict(batch):  # logits, say, not probabilities: the weighted sum at a window's centre is 1e5
        return np.full(batch.shape[:4] + (1,), 1e5, np.float32)

    message = (r"float16 accumulation overflowed in the window at \(0, 0, 0\): predictions up to 1e\+05 summed over "
               r"overlapping windows exceed float16's 65504\. Use accumulate='float32'")
    with pytest.raises(AccumulationOverflowError, match=message) as info:
        sliding_window(image, predict, 16, num_classes=1, accumulate="float16")
    assert info.value.window_start == (0, 0, 0)
    assert info.value.max_abs_output == 1e5
    out = sliding_window(image, predict, 16, num_classes=1, accumulate="float32")
    np.testing.assert_allclose(out, 1e5, rtol=1e-6)


def test_sliding_window_errors():
    image = np.zeros((20, 20, 20, 1), np.float32)

    def good(batch):
        return np.zeros(batch.shape[:4] + (2,), np.float32)

    with pytest.raises(UsageError, match=r"Invalid accumulate 'float61': expected one of float32, float16\. "
                                         r"Did you mean 'float16'\?"):
        sliding_window(image, good, 16, num_classes=2, accumulate="float61")
    with pytest.raises(DataError, match=r"sliding_window: image has shape \(20, 20, 20\); expected \(D, H, W, C\)"):
        sliding_window(image[..., 0], good, 16, num_classes=2)
    with pytest.raises(UsageError, match=r"Invalid batch_size 0: expected a positive number of windows"):
        sliding_window(image, good, 16, num_classes=2, batch_size=0)
    with pytest.raises(UsageError, match=r"Invalid overlap -0.1"):
        sliding_window(image, good, 16, num_classes=2, overlap=-0.1)
    with pytest.raises(InferenceError, match=r"predict returned shape \(1, 16, 16, 16, 2\) for a batch of 1 windows; "
                                             r"expected \(1, 16, 16, 16, 3\)"):
        sliding_window(image, good, 16, num_classes=3)
    with pytest.raises(InferenceError, match=r"predict returned NaN/Inf for the batch starting at window \(0, 0, 0\)"):
        sliding_window(image, lambda b: np.full(b.shape[:4] + (2,), np.nan, np.float32), 16, num_classes=2)
