"""Sums over the spatial axes that stay accurate past 2^24 elements per output.

TF 2.21's CPU float32 sum over an outer axis with fewer than 8 elements left inside it (a
"column" reduction such as (1, N, 3) over N: the Dice sums per class, per-channel norm statistics
of a few channels) accumulates each output linearly in float32, so it stops growing at 2^24 times
the typical term: the sum of 2^25 ones over (1, 2^25, 2) comes out as 2^24 (8 or more inner
elements, and reductions over the innermost axis, are exact; measurements:
benchmarks/results/kernels.md). ``spatial_sum`` reduces one axis at a time, innermost first, so
no single reduction adds more terms than one axis is long.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def spatial_sum(t: tf.Tensor, axes: Sequence[int] = (1, 2, 3), keepdims: bool = False) -> tf.Tensor:
    """``tf.reduce_sum(t, axes)``, one axis at a time from the last, accurate for any size.

    Args:
        t: a tensor of known rank, e.g. ``(batch, D, H, W, C)``.
        axes: the axes to sum, non-negative (default ``(1, 2, 3)``: D, H, W).
        keepdims: keep the summed axes with length 1 (default False).

    Returns:
        The sums in ``t``'s dtype, ``(batch, C)`` for the defaults; each stage adds at most one
        axis's length of terms.

    Example:
        >>> spatial_sum(tf.ones((1, 512, 512, 512, 3)))  # [[1.342e8, 1.342e8, 1.342e8]], exact
    """
    for axis in sorted(axes, reverse=True):
        t = tf.reduce_sum(t, axis=axis, keepdims=True)
    return t if keepdims else tf.squeeze(t, axis=sorted(axes))
