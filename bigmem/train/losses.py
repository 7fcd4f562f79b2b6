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

import functools
from typing import NamedTuple, Sequence

import tensorflow as tf

from bigmem.data.pipeline import PAD_LABEL
from bigmem.nets.limits import counted
from bigmem.nets.reduce import spatial_sum
from bigmem.nets.slabplan import Slab, plan_planewise
from bigmem.nets.slabs import as_planes, exceeds_limit, sum_slabs, take_planes, write_slabs

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


def _loss_slabs(logits: tf.Tensor) -> tuple[Slab, ...]:
    """The loss's slabs: whole planes, as many as ``slab_elements`` allows (it reads no halo)."""
    return plan_planewise(logits.shape, what=f"the loss on {tuple(logits.shape)}")


class _LossSums(NamedTuple):
    """One sample's sums over its slabs: the cross-entropy (softmax, or binary per region in ``region_loss``) and
    valid voxels, and per class (or region) the soft Dice terms."""

    cross_entropy: tf.Tensor  # ()
    intersection: tf.Tensor  # (num_classes,)
    predicted: tf.Tensor
    true: tf.Tensor
    voxels: tf.Tensor  # ()


def _slab_probabilities(label_planes, logit_planes, depth: int, sample: int, slab: Slab):
    """One slab's softmax (zero on padding), one-hot truth and valid mask (..., 1)."""
    slab_labels = take_planes(label_planes, depth, sample, slab.in_start, slab.in_stop)
    valid = _valid(slab_labels, logit_planes.dtype)
    probs = tf.nn.softmax(take_planes(logit_planes, depth, sample, slab.in_start, slab.in_stop)) * valid
    truth = tf.one_hot(tf.cast(slab_labels[..., 0], tf.int32), logit_planes.shape[-1], dtype=logit_planes.dtype)
    return probs, truth, valid


def _slab_sums(label_planes, logit_planes, depth: int, sample: int, slab: Slab) -> _LossSums:
    """One slab's terms of ``_LossSums``."""
    piece = take_planes(logit_planes, depth, sample, slab.in_start, slab.in_stop)
    probs, truth, valid = _slab_probabilities(label_planes, logit_planes, depth, sample, slab)
    axes = (0, 1, 2, 3)
    return _LossSums(tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(truth, piece)),
                     spatial_sum(probs * truth, axes), spatial_sum(probs, axes), spatial_sum(truth, axes),
                     spatial_sum(valid, axes)[0])


def _sample_sums(label_planes, logit_planes, depth: int, sample: int, slabs: Sequence[Slab],
                 after: list[tf.Tensor]) -> _LossSums:
    """One sample's ``_LossSums``, slab after slab, the first after ``after`` (one slab's softmax alive at a time)."""
    num_classes = logit_planes.shape[-1]
    sums = _LossSums(tf.zeros(()), *(tf.zeros((num_classes,)),) * 3, tf.zeros(()))
    for slab in slabs:
        with tf.control_dependencies(after):
            sums = _LossSums(*(total + term for total, term in zip(
                sums, _slab_sums(label_planes, logit_planes, depth, sample, slab))))
        after = list(sums)
    return sums


def _sample_loss(sums: _LossSums) -> tuple[tf.Tensor, tf.Tensor]:
    """(the sample's loss, the soft Dice's denominator per class) from its sums."""
    denominator = sums.predicted + sums.true + DICE_SMOOTH
    dice = (2.0 * sums.intersection + DICE_SMOOTH) / denominator
    return sums.cross_entropy / sums.voxels + 1.0 - tf.reduce_mean(dice[1:]), denominator


def _dice_grad_coefficients(sums: _LossSums, denominator: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(a, b) per class with d(1 - mean_k>=1 Dice_k) / d p_k(v) = a_k t_k(v) + b_k."""
    num_classes = sums.intersection.shape[0]
    foreground = tf.constant([0.0] + [1.0 / (num_classes - 1)] * (num_classes - 1))
    a = -2.0 * foreground / denominator
    b = foreground * (2.0 * sums.intersection + DICE_SMOOTH) / (denominator * denominator)
    return a, b


def _slab_logit_grad(label_planes, logit_planes, depth: int, sample_grads, upstream, sample: int,
                     slab: Slab) -> tf.Tensor:
    """d loss / d logits on one slab: (p - t) / N for the cross-entropy, p * (g - sum_k p_k g_k) for the Dice.

    ``sample_grads[sample]`` is ``(a, b, N)``: g_k = a_k t_k + b_k, N the sample's valid voxels.
    probs is zero on padding, and so is truth: padded logits get no gradient.
    """
    a, b, voxels = sample_grads[sample]
    probs, truth, _ = _slab_probabilities(label_planes, logit_planes, depth, sample, slab)
    g = a * truth + b
    piece = (probs - truth) / voxels + probs * (g - tf.reduce_sum(probs * g, axis=-1, keepdims=True))
    return piece * upstream[sample]


@counted('loss')
def dice_ce_per_sample_slabs(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """``dice_ce_per_sample`` over depth slabs, for logits past the kernel limit; the same values.

    Forward: one pass over each sample's slabs sums the cross-entropy and, per class, the soft
    Dice terms (intersection, predicted and true volumes). Backward: a second pass writes
    d loss / d logits slab by slab (``write_slabs``): (p - t) / N for the cross-entropy and, for
    the Dice, p * (g - sum_k p_k g_k) with g_k = d(1 - mean Dice) / d p_k = a_k t_k + b_k per
    class. Only one slab's softmax and one-hot are ever alive.

    Args:
        labels: (batch, D, H, W) integer class indices.
        logits: (batch, D, H, W, num_classes) float32, static shape.

    Returns:
        (batch,) float32 losses.

    Raises:
        SlabTooLargeError: one depth plane of the logits is already past the kernel limit.
    """
    batch, depth = logits.shape[:2]
    slabs = _loss_slabs(logits)
    label_planes = _label_planes(labels)

    @tf.custom_gradient
    def per_sample(logits):
        logit_planes = as_planes(logits)
        sums, after = [], []
        for sample in range(batch):
            sums.append(_sample_sums(label_planes, logit_planes, depth, sample, slabs, after))
            after = list(sums[-1])
        losses, denominators = zip(*(_sample_loss(s) for s in sums))

        def grad(upstream):  # upstream: (batch,)
            sample_grads = [(*_dice_grad_coefficients(s, d), s.voxels) for s, d in zip(sums, denominators)]
            return write_slabs(logits.shape, logits.dtype, slabs, functools.partial(
                _slab_logit_grad, label_planes, logit_planes, depth, sample_grads, upstream))

        return tf.stack(losses), grad

    return per_sample(logits)


def deep_supervision_weights(num_levels: int) -> list[float]:
    """nnU-Net's deep-supervision weights for a decoder with ``num_levels`` outputs, finest first.

    ``1 / 2**i`` for output ``i``, the lowest resolution's set to 0, normalised to sum 1
    (``nnUNetTrainer._build_loss``). The zero-weight output is not built (``ModelConfig.supervised_levels``),
    so callers pass ``depth`` and use the first ``depth - 1`` weights.

    Example:
        >>> deep_supervision_weights(4)  # [1, 1/2, 1/4, 0] / 1.75
        [0.5714285714285714, 0.2857142857142857, 0.14285714285714285, 0.0]
    """
    weights = [1.0 / 2**i for i in range(num_levels)]
    weights[-1] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


def downsampled_labels(labels: tf.Tensor, spatial_shape) -> tf.Tensor:
    """``labels`` (B, D, H, W) at ``spatial_shape``, as nnU-Net's ``DownsampleSegForDSTransform`` makes them.

    nnU-Net interpolates the full-resolution map with ``nearest-exact``: output voxel ``i`` takes
    input voxel ``floor((i + 0.5) * factor)``, which for an integer factor ``f`` is a strided slice
    from ``f // 2``. Padding (``PAD_LABEL``) stays padding wherever the voxel taken is padding, so
    the masking of every scale comes with the labels.
    """
    factors = [int(full) // int(small) for full, small in zip(labels.shape[1:4], spatial_shape)]
    if factors == [1, 1, 1]:
        return labels
    return labels[:, factors[0] // 2::factors[0], factors[1] // 2::factors[1], factors[2] // 2::factors[2]]


def supervised(loss_per_sample):
    """``loss_per_sample(labels, logits)`` extended to a deep-supervision list ``[logits, lower, ...]``.

    Each output's loss is taken against the labels downsampled to it (``downsampled_labels``) and
    weighted as nnU-Net weights them (``deep_supervision_weights``); a single tensor is passed through.
    """

    def per_sample(labels: tf.Tensor, outputs) -> tf.Tensor:
        if not isinstance(outputs, (list, tuple)):
            return loss_per_sample(labels, outputs)
        weights = deep_supervision_weights(len(outputs) + 1)  # + the lowest level, weight 0, not built
        return tf.add_n([weights[i] * loss_per_sample(downsampled_labels(labels, out.shape[1:4]), out)
                         for i, out in enumerate(outputs)])

    return per_sample


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
        counts = sum_slabs((2, num_classes), batch, _loss_slabs(logits), lambda sample, slab: tf.stack(dice_counts(
            take_planes(label_planes, depth, sample, slab.in_start, slab.in_stop)[..., 0],
            take_planes(logit_planes, depth, sample, slab.in_start, slab.in_stop))), after=[])
        return counts[0], counts[1]
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
