"""Dice + CE loss and the foreground Dice metric, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from bigmem.train.losses import dice_ce_loss, foreground_dice


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
