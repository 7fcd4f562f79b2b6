"""Gaussian-weighted sliding-window inference over a volume too large for one forward pass.

The windows and weights follow MONAI's ``sliding_window_inference(mode="gaussian",
sigma_scale=0.125)`` (``monai/inferers/utils.py``: ``_get_scan_interval``, ``dense_patch_slices``;
``monai/data/utils.py``: ``compute_importance_map``), which a benchmark compares against, and
nnU-Net's sliding-window predictor (sigma = window / 8, every voxel with a positive weight):

- a volume smaller than the window is padded to it, ``(window - size) // 2`` before, at each
  channel's background (``Preprocessing.background``), as training pads (MONAI pads with zeros);
- windows step by ``int(window * (1 - overlap))`` (at least 1) from 0, and the last one is moved
  back to end at the volume's edge, so every voxel is covered and no window leaves the volume;
- the weight is a separable Gaussian over voxel centres ``-(w - 1) / 2 .. (w - 1) / 2`` with
  ``sigma = sigma_scale * w``, floored at ``1e-3`` (MONAI's floor, which also keeps the weights
  normal float16 numbers) and, here, divided by its maximum;
- the result is ``sum(weight * prediction) / sum(weight)`` per voxel.

Differences from MONAI kept: the weights are computed in float64 and rounded to float32 (MONAI
computes in float32; the two differ by float32 rounding); they are scaled to a maximum of 1 (for
an even window MONAI's maximum is just under 1; the scale cancels in the quotient); arrays are
channels-last ``(D, H, W, C)`` and the output is always float32; the accumulators may be float16
(half the memory, checked for overflow). nnU-Net spaces its windows evenly between the two ends
instead of MONAI's fixed step with the last one moved back; this module follows MONAI.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

from bigmem.config.options import StrOption, look_up_option
from bigmem.errors import BigmemError, DataError, UsageError
from bigmem.infer import DEFAULT_OVERLAP

SIGMA_SCALE = 0.125  # MONAI's sliding_window_inference default, and nnU-Net's 1/8 of the patch size
MIN_WEIGHT = 1e-3  # MONAI's compute_importance_map floor: max(min(map), 1e-3)
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


class Accumulate(StrOption):
    FLOAT32 = "float32"
    FLOAT16 = "float16"


class InferenceError(BigmemError):
    """The predictor broke its contract (wrong shape, NaN/Inf), or the accumulation overflowed."""


class AccumulationOverflowError(InferenceError):
    """A float16 accumulator left float16's range (|x| > 65504) or became NaN.

    Args:
        message: the one-line explanation.
        window_start: ``(z, y, x)`` of the window whose addition overflowed.
        max_abs_output: the largest ``|prediction|`` in that window (float32).
    """

    def __init__(self, message: str, window_start: tuple[int, int, int], max_abs_output: float):
        super().__init__(message)
        self.window_start = tuple(int(s) for s in window_start)
        self.max_abs_output = float(max_abs_output)


def _window_shape(window: int | Sequence[int]) -> tuple[int, int, int]:
    shape = (int(window),) * 3 if np.isscalar(window) else tuple(int(w) for w in window)
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"Invalid window {window!r}: expected a positive size in voxels, or three (D, H, W).")
    return shape


def gaussian_weights(window: int | Sequence[int], sigma_scale: float = SIGMA_SCALE, *,
                     min_weight: float = MIN_WEIGHT) -> np.ndarray:
    """The importance map of one window: a separable Gaussian, largest at the centre.

    Args:
        window: the window's edge in voxels, or ``(D, H, W)``.
        sigma_scale: sigma as a fraction of the window edge (default 1/8, MONAI's and nnU-Net's).
        min_weight: the floor, applied before the scaling to a maximum of 1, as MONAI applies it
            (default 1e-3, MONAI's); a zero left by underflow becomes the smallest positive weight
            (nnU-Net), so every voxel has a weight.

    Returns:
        ``window`` float32, maximum exactly 1, symmetric along each axis, all > 0: MONAI's
        ``compute_importance_map(window, "gaussian", sigma_scale)`` divided by its maximum (1 for an
        odd window, just under 1 for an even one).

    Raises:
        UsageError: ``window`` < 1 or ``sigma_scale`` <= 0.

    Example:
        >>> w = gaussian_weights(128)
        >>> w.shape, w.max(), w.min()  # (128, 128, 128), 1.0, 0.001
    """
    shape = _window_shape(window)
    if not sigma_scale > 0:
        raise UsageError(f"Invalid sigma_scale {sigma_scale!r}: expected a positive fraction of the window (0.125).")
    weights = np.ones((1, 1, 1))
    for axis, n in enumerate(shape):
        x = np.arange(n, dtype=np.float64) - (n - 1) / 2
        profile = np.exp(-(x ** 2) / (2 * (sigma_scale * n) ** 2))
        weights = weights * profile.reshape([-1 if a == axis else 1 for a in range(3)])
    weights = np.maximum(weights, float(min_weight))  # floored before scaling, as MONAI floors its unscaled map
    weights = (weights / weights.max()).astype(np.float32)
    if not weights.min() > 0:  # underflow (min_weight 0 or tiny): nnU-Net's smallest positive weight
        weights[weights == 0] = weights[weights > 0].min()
    return weights


def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Where windows start along one axis, as MONAI's ``dense_patch_slices`` places them.

    Args:
        size: the axis's length in voxels; when smaller than ``window`` the volume is padded to
            ``window`` first and the one start (0) is in the padded volume.
        window: the window's length.
        overlap: the fraction of a window shared with the next, in [0, 1).

    Returns:
        Increasing starts: ``0, step, 2 * step, ...`` with ``step = max(1, int(window * (1 - overlap)))``,
        the last moved back to ``max(size, window) - window``; together they cover every voxel.

    Raises:
        UsageError: ``window`` < 1, ``size`` < 1 or ``overlap`` outside [0, 1).

    Example:
        >>> window_starts(35, 16, 0.5)
        [0, 8, 16, 19]
    """
    if window < 1 or size < 1:
        raise UsageError(f"Invalid window {window} for an axis of {size} voxels: both must be at least 1.")
    if not 0 <= overlap < 1:
        raise UsageError(f"Invalid overlap {overlap!r}: expected a fraction in [0, 1), e.g. 0.5.")
    size = max(size, window)
    step = max(1, int(window * (1 - overlap)))  # MONAI's _get_scan_interval, same float expression
    count = -(-(size - window) // step) + 1  # the first d with d * step + window >= size, plus one
    return [min(d * step, size - window) for d in range(count)]


def _check_output(out, n: int, window: tuple[int, int, int], num_classes: int, start) -> np.ndarray:
    out = np.asarray(out)
    expected = (n, *window, num_classes)
    if out.shape != expected:
        raise InferenceError(f"predict returned shape {out.shape} for a batch of {n} windows; expected {expected} "
                             "(batch, D, H, W, num_classes).")
    out = out.astype(np.float32, copy=False)
    if not np.isfinite(out.sum(dtype=np.float64)):
        raise InferenceError(f"predict returned NaN/Inf for the batch starting at window {tuple(start)}; "
                             "check the model and the input's normalisation.")
    return out


def sliding_window(image: np.ndarray, predict: Callable[[np.ndarray], np.ndarray], window: int | Sequence[int], *,
                   num_classes: int, overlap: float = DEFAULT_OVERLAP, accumulate: str = "float32",
                   batch_size: int = 1, sigma_scale: float = SIGMA_SCALE,
                   progress: Callable[[int, int], None] | None = None,
                   pad_value: np.ndarray | float | None = None) -> np.ndarray:
    """Predict a whole volume window by window, blending overlaps with Gaussian weights.

    Memory: the (padded) input, two accumulators ``(D, H, W, num_classes)`` and ``(D, H, W)`` in the
    ``accumulate`` dtype, one batch, and for float16 the float32 result; float32 divides in place.

    Args:
        image: ``(D, H, W, C)`` float32, normalised as in training; any size (an axis shorter than
            the window is zero-padded, centred, and cropped back).
        predict: ``(n, wD, wH, wW, C)`` float32 -> ``(n, wD, wH, wW, num_classes)`` probabilities.
        window: the window edge in voxels, or ``(wD, wH, wW)``; the network's size contract applies.
        num_classes: the channels ``predict`` returns.
        overlap: the fraction of a window shared with its neighbour, in [0, 1) (default
            ``DEFAULT_OVERLAP``, 0.5, as nnU-Net; MONAI's default is 0.25).
        accumulate: ``"float32"`` (default) or ``"float16"`` accumulators; float16 halves their
            memory but rounds every sum to 11 significant bits, so where many windows' low-weight
            tails overlap a probability can be off by up to ~0.01 (mean ~3e-4: tests/infer/
            test_sliding.py); an overflow raises.
        batch_size: windows per ``predict`` call (default 1).
        sigma_scale: the Gaussian's sigma as a fraction of the window (default 1/8).
        progress: called as ``progress(windows_done, windows_total)`` after each batch.
        pad_value: the value of voxels padded where the volume is smaller than a window, per channel
            or one (default None: each channel's minimum; predict gives ``Preprocessing.background``).

    Returns:
        ``(D, H, W, num_classes)`` float32: the weighted mean of the windows' predictions.

    Raises:
        DataError: ``image`` is not ``(D, H, W, C)``.
        UsageError: a bad window, overlap, batch size or accumulate value.
        InferenceError: ``predict`` returned another shape, or NaN/Inf.
        AccumulationOverflowError: a float16 accumulator overflowed (use ``accumulate="float32"``).

    Example:
        >>> probs = sliding_window(image, lambda x: model.predict_on_batch(x), 128, num_classes=4)
        >>> labels = probs.argmax(-1)  # (D, H, W)
    """
    shape, dtype = _checked(image, window, accumulate, batch_size, num_classes)
    size = image.shape[:3]
    image, widths = _padded_to_window(image, shape, pad_value)
    starts = list(itertools.product(*[window_starts(s, w, overlap) for s, w in zip(size, shape)]))
    weights = gaussian_weights(shape, sigma_scale)
    weights_acc = weights.astype(dtype)
    total = np.zeros(image.shape[:3] + (num_classes,), dtype)
    weight_sum = np.zeros(image.shape[:3], dtype)
    for first in range(0, len(starts), batch_size):
        batch_starts = starts[first:first + batch_size]
        regions = [tuple(slice(s, s + w) for s, w in zip(start, shape)) for start in batch_starts]
        batch = np.stack([image[region] for region in regions]).astype(np.float32, copy=False)
        out = _check_output(predict(batch), len(regions), shape, num_classes, batch_starts[0])
        for start, region, prediction in zip(batch_starts, regions, out):
            _accumulate(total, weight_sum, region, prediction, weights, weights_acc, start)
        if progress is not None:
            progress(first + len(regions), len(starts))
    return _weighted_mean(total, weight_sum, widths, size)


def _checked(image: np.ndarray, window, accumulate: str, batch_size, num_classes) -> tuple:
    """``sliding_window``'s window shape and accumulator dtype, once its arguments are ones it can use."""
    if image.ndim != 4:
        raise DataError(f"sliding_window: image has shape {image.shape}; expected (D, H, W, C).")
    shape = _window_shape(window)
    dtype = np.dtype(look_up_option(accumulate, Accumulate, flag="accumulate").value)
    if int(batch_size) != batch_size or batch_size < 1:
        raise UsageError(f"Invalid batch_size {batch_size!r}: expected a positive number of windows.")
    if int(num_classes) != num_classes or num_classes < 1:
        raise UsageError(f"Invalid num_classes {num_classes!r}: expected the number of channels predict returns.")
    return shape, dtype


def _padded_to_window(image: np.ndarray, window: Sequence[int], pad_value) -> tuple[np.ndarray, list]:
    """``image`` with each axis shorter than the window padded, centred, at each channel's background (as training
    pads: ``pad_value``, else the channel's minimum); and the (before, after) widths."""
    size = image.shape[:3]
    widths = [((max(s, w) - s) // 2, max(s, w) - s - (max(s, w) - s) // 2) for s, w in zip(size, window)]
    if any(before or after for before, after in widths):
        padded = np.empty(tuple(s + b + a for s, (b, a) in zip(size, widths)) + image.shape[3:], image.dtype)
        padded[...] = image.min(axis=(0, 1, 2)) if pad_value is None else pad_value
        padded[tuple(slice(b, b + s) for s, (b, _) in zip(size, widths))] = image
        image = padded
    return image, widths


def _accumulate(total: np.ndarray, weight_sum: np.ndarray, region: tuple, prediction: np.ndarray,
                weights: np.ndarray, weights_acc: np.ndarray, start) -> None:
    """One window's weighted prediction added to the accumulators; a float16 overflow raised where it happens."""
    accumulator = total[region]
    with np.errstate(over="ignore", invalid="ignore"):  # checked below, with a better message
        accumulator += prediction * weights[..., None]
    weight_sum[region] += weights_acc
    if total.dtype == np.float16 and not np.isfinite(accumulator.sum(dtype=np.float32)):
        peak = float(np.abs(prediction).max())
        raise AccumulationOverflowError(
            f"float16 accumulation overflowed in the window at {tuple(start)}: predictions up to {peak:.4g} "
            f"summed over overlapping windows exceed float16's {FLOAT16_MAX:.0f}. Use accumulate='float32' "
            "(twice the accumulator memory), or make predict return probabilities.", start, peak)


def _weighted_mean(total: np.ndarray, weight_sum: np.ndarray, widths: list, size: tuple) -> np.ndarray:
    """``total / weight_sum`` cropped back to ``size``, float32: in place for float32 accumulators."""
    keep = tuple(slice(before, before + s) for (before, _), s in zip(widths, size))
    num_classes = total.shape[-1]
    if total.dtype == np.float32:
        for k in range(num_classes):
            np.divide(total[..., k], weight_sum, out=total[..., k])
        return np.ascontiguousarray(total[keep]) if any(b or a for b, a in widths) else total
    result = np.empty(size + (num_classes,), np.float32)
    for k in range(num_classes):
        np.divide(total[keep + (k,)], weight_sum[keep], out=result[..., k], dtype=np.float32)
    return result
