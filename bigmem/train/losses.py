"""Dice + cross-entropy loss and the mean foreground Dice metric (TensorFlow ops).

The loss follows nnU-Net / MLPerf 3D U-Net: softmax cross-entropy plus (1 - soft Dice), with
the soft Dice computed per sample and per foreground class, then averaged.
"""

from __future__ import annotations

import tensorflow as tf

DICE_SMOOTH = 1e-5  # nnU-Net's smoothing term for the soft Dice


def dice_ce_per_sample(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Loss of each sample, shape (B,): mean voxel cross-entropy + (1 - mean foreground soft Dice).

    Per-sample terms let a data-parallel step average over the *global* batch exactly (each
    replica sums its samples' losses and divides by the global batch size).
    """
    num_classes = logits.shape[-1]
    onehot = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=logits.dtype)
    spatial = (1, 2, 3)
    cross_entropy = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(onehot, logits), axis=spatial)
    probs = tf.nn.softmax(logits)
    intersection = tf.reduce_sum(probs * onehot, axis=spatial)
    denominator = tf.reduce_sum(probs, axis=spatial) + tf.reduce_sum(onehot, axis=spatial)
    dice = (2.0 * intersection + DICE_SMOOTH) / (denominator + DICE_SMOOTH)  # (B, K)
    return cross_entropy + (1.0 - tf.reduce_mean(dice[:, 1:], axis=1))


def dice_ce_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Scalar loss for integer ``labels`` (B, D, H, W) and float32 ``logits`` (B, D, H, W, K)."""
    return tf.reduce_mean(dice_ce_per_sample(labels, logits))


def dice_counts(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Per class: (|prediction AND truth|, |prediction| + |truth|) over the batch (summable across replicas)."""
    num_classes = logits.shape[-1]
    predicted = tf.one_hot(tf.argmax(logits, axis=-1, output_type=tf.int32), num_classes, dtype=tf.float32)
    truth = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=tf.float32)
    axes = (0, 1, 2, 3)
    return (tf.reduce_sum(predicted * truth, axis=axes),
            tf.reduce_sum(predicted, axis=axes) + tf.reduce_sum(truth, axis=axes))


def dice_from_counts(intersection: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
    dice = tf.where(total > 0, 2.0 * intersection / tf.maximum(total, 1.0), 1.0)
    return tf.reduce_mean(dice[1:])


def foreground_dice(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean hard Dice over the foreground classes, pooled over the batch.

    A class absent from both prediction and label scores 1 (nothing to find, nothing found).
    """
    return dice_from_counts(*dice_counts(labels, logits))
