"""Spatial sums stay exact past 2^24 terms per output, where TF's one-step float32 sum saturates."""

import numpy as np
import tensorflow as tf

from bigmem.nets.reduce import spatial_sum


def test_spatial_sum_is_exact_past_2_24_terms():
    ones = tf.ones((1, 320, 320, 320, 3))  # 3.3e7 terms per class, 393 MB
    np.testing.assert_array_equal(spatial_sum(ones), [[320**3] * 3])
    np.testing.assert_array_equal(spatial_sum(ones, (0, 1, 2, 3)), [320**3] * 3)
    assert spatial_sum(ones, keepdims=True).shape == (1, 1, 1, 1, 3)


def test_dice_counts_and_loss_on_a_large_volume():
    """Half the volume is class 1 and every probability 0.5: soft Dice 0.5 (TF's one-step sums give 0.66)."""
    import math

    from bigmem.train.losses import dice_ce_per_sample, dice_counts

    half = (1, 160, 320, 320)
    labels = tf.concat([tf.ones(half, tf.uint8), tf.zeros(half, tf.uint8)], axis=1)
    logits = tf.zeros((1, 320, 320, 320, 2))
    intersection, total = dice_counts(labels, logits)  # argmax of a tie is class 0 everywhere
    np.testing.assert_array_equal(intersection, [160 * 320**2, 0])
    np.testing.assert_array_equal(total, [320**3 + 160 * 320**2, 160 * 320**2])
    loss = float(dice_ce_per_sample(labels, logits)[0])
    assert abs(loss - (math.log(2) + 0.5)) < 1e-4  # cross-entropy ln 2, plus 1 - Dice 0.5
