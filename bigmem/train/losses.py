"""Dice + cross-entropy loss and the mean foreground Dice metric (TensorFlow ops).

The loss follows nnU-Net / MLPerf 3D U-Net: softmax cross-entropy plus (1 - soft Dice), with
the soft Dice computed per sample and per foreground class, then averaged.

Voxels labelled ``PAD_LABEL`` are padding (``data.pipeline``): they count in no term. Their
one-hot is all zeros, so the cross-entropy and the true volume leave them out by themselves;
the predicted volume and the voxel count are taken over the valid voxels only. A padded
sample's loss, and its gradients with respect to the logits of its real voxels, equal those of
the same logits unpadded (``tests/train/test_losses.py``).
"""

from __future__ import annotations

import tensorflow as tf

from bigmem.data.pipeline import PAD_LABEL
from bigmem.nets.limits import counted
from bigmem.nets.reduce import spatial_sum
from bigmem.nets.slabs import PlaneWriter, as_planes, exceeds_limit, plan_slabs, slab_elements, take_planes

DICE_SMOOTH = 1e-5  # nnU-Net's smoothing term for the soft Dice


def dice_ce_per_sample(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Loss of each sample, shape (B,): mean voxel cross-entropy + (1 - mean foreground soft Dice).

    Per-sample terms let a data-parallel step average over the *global* batch exactly (each
    replica sums its samples' losses and divides by the global batch size). Logits past the
    kernel limit are scored in depth slabs (``dice_ce_per_sample_slabs``).
    """
    if exceeds_limit(logits.shape):
        return dice_ce_per_sample_slabs(labels, logits)
    num_classes = logits.shape[-1]
    onehot = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=logits.dtype)  # PAD_LABEL: all zeros
    spatial = (1, 2, 3)
    valid = _valid(labels, logits.dtype)
    voxels = spatial_sum(valid, spatial)
    # TF's op backpropagates softmax - labels, which is not 0 where labels are all zero: mask it.
    cross_entropy = spatial_sum(tf.nn.softmax_cross_entropy_with_logits(onehot, logits) * valid, spatial) / voxels
    probs = tf.nn.softmax(logits) * valid[..., tf.newaxis]
    # Per class over the volume: TF's own reduce_sum saturates there past 2^24 (nets/reduce.py).
    intersection = spatial_sum(probs * onehot, spatial)
    denominator = spatial_sum(probs, spatial) + spatial_sum(onehot, spatial)
    dice = (2.0 * intersection + DICE_SMOOTH) / (denominator + DICE_SMOOTH)  # (B, K)
    return cross_entropy + (1.0 - tf.reduce_mean(dice[:, 1:], axis=1))


def _valid(labels: tf.Tensor, dtype) -> tf.Tensor:
    """1 where a voxel is part of the scan, 0 where it is padding (``PAD_LABEL``)."""
    return tf.cast(tf.not_equal(labels, tf.constant(PAD_LABEL, labels.dtype)), dtype)


def _label_planes(labels: tf.Tensor) -> tf.Tensor:
    """(B, D, H, W) labels as (B*D, H, W, 1) rows, so take_planes reads them like feature maps."""
    return tf.reshape(labels, (labels.shape[0] * labels.shape[1], *labels.shape[2:], 1))


def _loss_slabs(logits: tf.Tensor) -> list[tuple[int, int]]:
    batch, depth, height, width, num_classes = logits.shape
    plane = height * width * num_classes
    limit = slab_elements(plane)
    return plan_slabs(depth, lambda d0, d1: (d1 - d0) * plane <= limit, what=f"the loss on {tuple(logits.shape)}")


@counted('loss')
def dice_ce_per_sample_slabs(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """``dice_ce_per_sample`` over depth slabs, for logits past the kernel limit; the same values.

    Forward: one pass over each sample's slabs sums the cross-entropy and, per class, the soft
    Dice terms (intersection, predicted and true volumes). Backward: a second pass writes
    d loss / d logits slab by slab: (p - t) / N for the cross-entropy and, for the Dice,
    p * (g - sum_k p_k g_k) with g_k = d(1 - mean Dice) / d p_k = a_k t_k + b_k per class. Only
    one slab's softmax and one-hot are ever alive.

    Args:
        labels: (batch, D, H, W) integer class indices.
        logits: (batch, D, H, W, num_classes) float32, static shape.

    Returns:
        (batch,) float32 losses.
    """
    batch, depth, height, width, num_classes = logits.shape
    slabs = _loss_slabs(logits)
    label_planes = _label_planes(labels)

    def probabilities_and_truth(logit_planes, sample, d0, d1):
        """One slab's softmax (zero on padding), one-hot truth and valid mask (..., 1)."""
        slab_labels = take_planes(label_planes, depth, sample, d0, d1)
        valid = _valid(slab_labels, logits.dtype)
        probs = tf.nn.softmax(take_planes(logit_planes, depth, sample, d0, d1)) * valid
        truth = tf.one_hot(tf.cast(slab_labels[..., 0], tf.int32), num_classes, dtype=logits.dtype)
        return probs, truth, valid

    @tf.custom_gradient
    def per_sample(logits):
        logit_planes = as_planes(logits)
        losses, terms, counts, last = [], [], [], []
        for sample in range(batch):
            cross_entropy = voxels = tf.zeros(())
            intersection = predicted = true = tf.zeros((num_classes,))
            for d0, d1 in slabs:
                with tf.control_dependencies(last):
                    piece = take_planes(logit_planes, depth, sample, d0, d1)
                    probs, truth, valid = probabilities_and_truth(logit_planes, sample, d0, d1)
                    cross_entropy += tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(truth, piece))
                    intersection += spatial_sum(probs * truth, (0, 1, 2, 3))
                    predicted += spatial_sum(probs, (0, 1, 2, 3))
                    true += spatial_sum(truth, (0, 1, 2, 3))
                    voxels += spatial_sum(valid, (0, 1, 2, 3))[0]
                last = [cross_entropy, intersection, predicted, true, voxels]
            denominator = predicted + true + DICE_SMOOTH
            dice = (2.0 * intersection + DICE_SMOOTH) / denominator
            losses.append(cross_entropy / voxels + 1.0 - tf.reduce_mean(dice[1:]))
            terms.append((intersection, denominator))
            counts.append(voxels)
        loss = tf.stack(losses)

        def grad(upstream):  # upstream: (batch,)
            dlogits = PlaneWriter(logits.shape, logits.dtype)
            foreground = tf.constant([0.0] + [1.0 / (num_classes - 1)] * (num_classes - 1))
            for sample in range(batch):
                intersection, denominator = terms[sample]
                # d(1 - mean_k>=1 Dice_k) / d p_k(v) = a_k t_k(v) + b_k
                a = -2.0 * foreground / denominator
                b = foreground * (2.0 * intersection + DICE_SMOOTH) / (denominator * denominator)
                for d0, d1 in slabs:
                    with tf.control_dependencies(dlogits.after):
                        # probs is zero on padding, and so is truth: padded logits get no gradient
                        probs, truth, _ = probabilities_and_truth(logit_planes, sample, d0, d1)
                        g = a * truth + b
                        piece = (probs - truth) / counts[sample] + probs * (g - tf.reduce_sum(probs * g, axis=-1,
                                                                                               keepdims=True))
                    dlogits.write(sample, d0, piece * upstream[sample])
            return dlogits.result()

        return loss, grad

    return per_sample(logits)


def dice_ce_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Scalar loss for integer ``labels`` (B, D, H, W) and float32 ``logits`` (B, D, H, W, K)."""
    return tf.reduce_mean(dice_ce_per_sample(labels, logits))


def dice_counts(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Per class: (|prediction AND truth|, |prediction| + |truth|) over the batch (summable across replicas).

    Padded voxels (``PAD_LABEL``) are left out. Logits past the kernel limit are counted slab by slab.
    """
    num_classes = logits.shape[-1]
    if exceeds_limit(logits.shape):
        batch, depth = logits.shape[:2]
        logit_planes, label_planes = as_planes(logits), _label_planes(labels)
        intersection = total = tf.zeros((num_classes,))
        for sample in range(batch):
            for d0, d1 in _loss_slabs(logits):
                with tf.control_dependencies([intersection, total]):
                    piece_counts = dice_counts(take_planes(label_planes, depth, sample, d0, d1)[..., 0],
                                               take_planes(logit_planes, depth, sample, d0, d1))
                intersection, total = intersection + piece_counts[0], total + piece_counts[1]
        return intersection, total
    predicted = tf.one_hot(tf.argmax(logits, axis=-1, output_type=tf.int32), num_classes, dtype=tf.float32)
    predicted *= _valid(labels, tf.float32)[..., tf.newaxis]  # padding is neither predicted nor true
    truth = tf.one_hot(tf.cast(labels, tf.int32), num_classes, dtype=tf.float32)
    axes = (0, 1, 2, 3)
    return (spatial_sum(predicted * truth, axes), spatial_sum(predicted, axes) + spatial_sum(truth, axes))


def dice_from_counts(intersection: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
    dice = tf.where(total > 0, 2.0 * intersection / tf.maximum(total, 1.0), 1.0)
    return tf.reduce_mean(dice[1:])


def foreground_dice(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean hard Dice over the foreground classes, pooled over the batch.

    A class absent from both prediction and label scores 1 (nothing to find, nothing found).
    """
    return dice_from_counts(*dice_counts(labels, logits))
