"""Dice + cross-entropy loss and the mean foreground Dice metric (TensorFlow ops).

The loss follows nnU-Net / MLPerf 3D U-Net: softmax cross-entropy plus (1 - soft Dice), with
the soft Dice computed per sample and per foreground class, then averaged.
"""

from __future__ import annotations

import tensorflow as tf

DICE_SMOOTH = 1e-5  # nnU-Net's smoothing term for the soft Dice


def dice_ce_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Scalar loss for integer ``labels`` (B, D, H, W) and float32 ``logits`` (B, D, H, W, K)."""
    num_classes = logits.shape[-1]
    onehot = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=logits.dtype)
    cross_entropy = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(onehot, logits))
    probs = tf.nn.softmax(logits)
    spatial = (1, 2, 3)
    intersection = tf.reduce_sum(probs * onehot, axis=spatial)
    denominator = tf.reduce_sum(probs, axis=spatial) + tf.reduce_sum(onehot, axis=spatial)
    dice = (2.0 * intersection + DICE_SMOOTH) / (denominator + DICE_SMOOTH)  # (B, K)
    return cross_entropy + (1.0 - tf.reduce_mean(dice[:, 1:]))


def foreground_dice(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean hard Dice over the foreground classes, pooled over the batch.

    A class absent from both prediction and label scores 1 (nothing to find, nothing found).
    """
    num_classes = logits.shape[-1]
    predicted = tf.one_hot(tf.argmax(logits, axis=-1, output_type=tf.int32), num_classes, dtype=tf.float32)
    truth = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=tf.float32)
    axes = (0, 1, 2, 3)
    intersection = tf.reduce_sum(predicted * truth, axis=axes)
    total = tf.reduce_sum(predicted, axis=axes) + tf.reduce_sum(truth, axis=axes)
    dice = tf.where(total > 0, 2.0 * intersection / tf.maximum(total, 1.0), 1.0)
    return tf.reduce_mean(dice[1:])
