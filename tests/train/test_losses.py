"""Dice + CE loss and the foreground Dice metric, against hand-computed values."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from bigmem.train.losses import dice_ce_loss, foreground_dice
from helpers import slab_calls


def _logits_for(labels: np.ndarray, num_classes: int, scale: float = 20.0) -> tf.Tensor:
    return tf.constant(np.eye(num_classes, dtype=np.float32)[labels] * scale)


def test_perfect_prediction():
    labels = np.random.default_rng(0).integers(0, 3, (2, 4, 4, 4)).astype(np.uint8)
    logits = _logits_for(labels, 3)
    assert float(foreground_dice(labels, logits)) == pytest.approx(1.0)
    assert float(dice_ce_loss(labels, logits)) == pytest.approx(0.0, abs=1e-4)


def test_hand_computed_dice():
    labels = np.zeros((1, 2, 2, 2), np.uint8)
    labels[0, 0, 0, :] = 1  # two voxels of class 1
    predicted = np.zeros_like(labels)
    predicted[0, 0, 0, 0] = 1  # one right
    predicted[0, 1, 1, 1] = 1  # one wrong
    logits = _logits_for(predicted, 3)
    # class 1: 2*1/(2+2) = 0.5; class 2 absent from both -> 1.0; mean = 0.75
    assert float(foreground_dice(labels, logits)) == pytest.approx(0.75)


def test_loss_is_cross_entropy_plus_soft_dice():
    labels = np.array([[[[0, 1]]]], np.uint8)  # (1, 1, 1, 2)
    logits = tf.zeros((1, 1, 1, 2, 2))  # uniform over 2 classes
    # CE = ln 2; soft Dice of class 1: 2 * 0.5 / (1.0 + 1) = 0.5 -> loss = ln 2 + 0.5
    assert float(dice_ce_loss(labels, logits)) == pytest.approx(np.log(2) + 0.5, rel=1e-4)


def _loss_and_grad(labels, logits, fn=None):
    from bigmem.train.losses import dice_ce_per_sample

    fn = fn or dice_ce_per_sample
    logits = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = fn(tf.constant(labels), logits)
    return loss.numpy(), tape.gradient(loss, logits).numpy()


@pytest.mark.parametrize("limit", [None, 3 * 5 * 3 * 4])  # whole, and in depth slabs
def test_a_padded_sample_scores_and_trains_as_the_unpadded_one(limit):
    """Padding (PAD_LABEL) adds nothing: the loss, the Dice counts and d loss / d logits of the real voxels
    equal the unpadded sample's, and padded logits get no gradient, whatever their values."""
    from bigmem.data.pipeline import PAD_LABEL
    from bigmem.nets.limits import kernel_element_limit
    from bigmem.train.losses import dice_counts

    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, (2, 7, 5, 3)).astype(np.uint8)
    logits = rng.normal(0, 2, (2, 7, 5, 3, 3)).astype(np.float32)
    padded_labels = np.full((2, 12, 5, 3), PAD_LABEL, np.uint8)
    padded_labels[:, 2:9] = labels
    padded_logits = rng.normal(0, 5, (2, 12, 5, 3, 3)).astype(np.float32)  # padding: arbitrary logits
    padded_logits[:, 2:9] = logits
    with kernel_element_limit(limit) if limit else contextlib.nullcontext(), slab_calls() as calls:
        loss, grad = _loss_and_grad(labels, logits)
        padded_loss, padded_grad = _loss_and_grad(padded_labels, padded_logits)
        counts = dice_counts(tf.constant(labels), tf.constant(logits))
        padded_counts = dice_counts(tf.constant(padded_labels), tf.constant(padded_logits))
    assert calls == ({"loss": 2} if limit else {})  # the sample and the padded one, in slabs where limited
    np.testing.assert_allclose(padded_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(padded_grad[:, 2:9], grad, rtol=1e-5, atol=1e-9)
    assert not np.any(padded_grad[:, :2])
    assert not np.any(padded_grad[:, 9:])
    for got, want in zip(padded_counts, counts):
        np.testing.assert_array_equal(got, want)


def test_deep_supervision_weights_are_nnunets():
    from bigmem.train.losses import deep_supervision_weights

    # nnUNetTrainer._build_loss with 5 outputs: [1, 1/2, 1/4, 1/8, 0] / 1.875
    expected = [1 / 1.875, 0.5 / 1.875, 0.25 / 1.875, 0.125 / 1.875, 0.0]
    np.testing.assert_allclose(deep_supervision_weights(5), expected)


def test_downsampled_labels_take_the_voxel_under_each_centre():
    from bigmem.train.losses import downsampled_labels

    labels = tf.reshape(tf.range(8 * 4 * 4, dtype=tf.int32), (1, 8, 4, 4))
    small = downsampled_labels(labels, (4, 2, 2)).numpy()
    # nearest-exact, factor 2: output i reads input floor((i + 0.5) * 2) = 2i + 1
    np.testing.assert_array_equal(small, labels.numpy()[:, 1::2, 1::2, 1::2])
    quarter = downsampled_labels(labels, (2, 1, 1)).numpy()
    np.testing.assert_array_equal(quarter, labels.numpy()[:, 2::4, 2::4, 2::4])


def test_supervised_loss_is_the_weighted_sum_over_levels():
    from bigmem.train.losses import dice_ce_per_sample, supervised

    rng = np.random.default_rng(1)
    labels = tf.constant(rng.integers(0, 3, (2, 8, 8, 8)).astype(np.uint8))
    full = tf.constant(rng.normal(size=(2, 8, 8, 8, 3)).astype(np.float32))
    half = tf.constant(rng.normal(size=(2, 4, 4, 4, 3)).astype(np.float32))
    by_hand = (2 / 3) * dice_ce_per_sample(labels, full) + (1 / 3) * dice_ce_per_sample(labels[:, 1::2, 1::2, 1::2],
                                                                                         half)
    np.testing.assert_allclose(supervised(dice_ce_per_sample)(labels, [full, half]).numpy(), by_hand.numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(supervised(dice_ce_per_sample)(labels, full).numpy(),
                               dice_ce_per_sample(labels, full).numpy())


def test_padding_is_left_out_at_every_supervised_scale():
    """A sample padded by whole 2x2x2 blocks scores as the unpadded one at full and half resolution."""
    from bigmem.data.pipeline import PAD_LABEL
    from bigmem.train.losses import dice_ce_per_sample, supervised

    rng = np.random.default_rng(2)
    labels = rng.integers(0, 3, (1, 8, 8, 8)).astype(np.uint8)
    full = rng.normal(size=(1, 8, 8, 8, 3)).astype(np.float32)
    half = rng.normal(size=(1, 4, 4, 4, 3)).astype(np.float32)
    padded_labels = np.full((1, 12, 8, 8), PAD_LABEL, np.uint8)
    padded_labels[:, :8] = labels
    padded_full = rng.normal(size=(1, 12, 8, 8, 3)).astype(np.float32)
    padded_full[:, :8] = full
    padded_half = rng.normal(size=(1, 6, 4, 4, 3)).astype(np.float32)
    padded_half[:, :4] = half
    loss = supervised(dice_ce_per_sample)
    np.testing.assert_allclose(loss(tf.constant(padded_labels), [tf.constant(padded_full), tf.constant(padded_half)]),
                               loss(tf.constant(labels), [tf.constant(full), tf.constant(half)]), rtol=1e-5)
