"""Region training as nnU-Net v2 does it: one sigmoid output per region, BCE + soft Dice.

A region (BraTS's whole tumour, tumour core, enhancing tumour) unites label values and regions
overlap, so they cannot be softmax classes. nnU-Net trains them as independent sigmoid outputs
with ``DC_and_BCE_loss`` (binary cross-entropy with logits, plus a soft Dice over every region,
background excluded as it is no region, smoothing 1e-5) and paints the prediction in
``regions_class_order`` (``infer/geometry.labels_to_source``).

Output ``i`` of the network is region ``i`` of the store's ``regions`` (their order in
dataset.json's ``labels``); its target is "the label value is one of the region's". The
``membership`` matrix ``(num_classes, num_regions)`` says which label values each region unites.
Padding (``PAD_LABEL``) counts in no term, as in the softmax loss: its one-hot row is zero, and
the valid mask takes it out of the predicted sums.

Per sample: the mean BCE over the valid voxels and the regions, plus 1 - the mean soft Dice of the
regions (nnU-Net returns -Dice; the constant 1 changes no gradient). Past the kernel limit the
loss runs in depth slabs with a hand-written gradient, as the softmax loss does.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from bigmem.nets.limits import counted
from bigmem.nets.reduce import spatial_sum
from bigmem.nets.slabplan import Slab
from bigmem.nets.slabs import as_planes, exceeds_limit, sum_slabs, take_planes, write_slabs
from bigmem.train.losses import DICE_SMOOTH, _label_planes, _loss_slabs, _LossSums, _valid


def membership(regions: Mapping[str, Sequence[int]], num_classes: int) -> np.ndarray:
    """``(num_classes, num_regions)`` float32: 1 where label value ``v`` belongs to region ``i``.

    Example:
        >>> membership({"whole": [1, 2, 3], "core": [2, 3], "enhancing": [3]}, 4)[:, 1]
        array([0., 0., 1., 1.], dtype=float32)
    """
    table = np.zeros((num_classes, len(regions)), np.float32)
    for i, values in enumerate(regions.values()):
        table[list(values), i] = 1.0
    return table


def region_targets(labels: tf.Tensor, member: tf.Tensor) -> tf.Tensor:
    """``(..., num_regions)`` float32 targets of integer ``labels``: zero on padding (its one-hot is zero)."""
    onehot = tf.one_hot(tf.cast(labels, tf.int32), member.shape[0], dtype=tf.float32)
    return tf.tensordot(onehot, member, axes=[[-1], [0]])


def region_dice_bce_per_sample(labels: tf.Tensor, logits: tf.Tensor, member) -> tf.Tensor:
    """Loss of each sample, shape (B,): mean BCE over valid voxels and regions + (1 - mean soft Dice).

    Args:
        labels: (batch, D, H, W) integer label values (``PAD_LABEL`` for padding).
        logits: (batch, D, H, W, num_regions) float32.
        member: ``membership`` of the store's regions.

    Returns:
        (batch,) float32 losses. Logits past the kernel limit are scored in depth slabs.
    """
    member = tf.constant(member, tf.float32)
    if exceeds_limit(logits.shape):
        return region_loss_slabs(labels, logits, member)
    spatial = (1, 2, 3)
    targets = region_targets(labels, member)
    valid = _valid(labels, logits.dtype)[..., tf.newaxis]
    voxels = spatial_sum(valid[..., 0], spatial)
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits) * valid
    bce = tf.reduce_sum(spatial_sum(bce, spatial), axis=-1) / (voxels * logits.shape[-1])
    probs = tf.sigmoid(logits) * valid
    intersection = spatial_sum(probs * targets, spatial)
    denominator = spatial_sum(probs, spatial) + spatial_sum(targets, spatial)
    dice = (2.0 * intersection + DICE_SMOOTH) / (denominator + DICE_SMOOTH)  # (B, R)
    return bce + 1.0 - tf.reduce_mean(dice, axis=1)


def _slab_terms(label_planes, logit_planes, member, depth: int, sample: int, slab: Slab):
    """One slab's logits, sigmoid (zero on padding), targets and valid mask (..., 1)."""
    slab_labels = take_planes(label_planes, depth, sample, slab.in_start, slab.in_stop)[..., 0]
    logits = take_planes(logit_planes, depth, sample, slab.in_start, slab.in_stop)
    valid = _valid(slab_labels, logits.dtype)[..., tf.newaxis]
    return logits, tf.sigmoid(logits) * valid, region_targets(slab_labels, member), valid


def _slab_sums(label_planes, logit_planes, member, depth: int, sample: int, slab: Slab) -> _LossSums:
    logits, probs, targets, valid = _slab_terms(label_planes, logit_planes, member, depth, sample, slab)
    axes = (0, 1, 2, 3)
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits) * valid
    return _LossSums(tf.reduce_sum(bce), spatial_sum(probs * targets, axes), spatial_sum(probs, axes),
                       spatial_sum(targets, axes), spatial_sum(valid, axes)[0])


def _sample_loss(sums: _LossSums, num_regions: int) -> tuple[tf.Tensor, tf.Tensor]:
    denominator = sums.predicted + sums.true + DICE_SMOOTH
    dice = (2.0 * sums.intersection + DICE_SMOOTH) / denominator
    return sums.cross_entropy / (sums.voxels * num_regions) + 1.0 - tf.reduce_mean(dice), denominator


def _slab_logit_grad(label_planes, logit_planes, member, depth: int, sample_grads, upstream, sample: int,
                     slab: Slab) -> tf.Tensor:
    """d loss / d logits on one slab: (s - t) / (N R) for the BCE, s (1 - s) (a t + b) for the Dice (valid only).

    ``sample_grads[sample]`` is ``(a, b, N)``: with D_r the Dice denominator, a_r = -2 / (R D_r) and
    b_r = (2 I_r + smooth) / (R D_r^2), the derivative of 1 - mean Dice with respect to s_r(v).
    """
    a, b, voxels = sample_grads[sample]
    logits, _, targets, valid = _slab_terms(label_planes, logit_planes, member, depth, sample, slab)
    sigmoid = tf.sigmoid(logits)
    num_regions = logits.shape[-1]
    piece = ((sigmoid - targets) / (voxels * num_regions) + sigmoid * (1.0 - sigmoid) * (a * targets + b)) * valid
    return piece * upstream[sample]


@counted('loss')
def region_loss_slabs(labels: tf.Tensor, logits: tf.Tensor, member: tf.Tensor) -> tf.Tensor:
    """``region_dice_bce_per_sample`` over depth slabs, for logits past the kernel limit; the same values.

    Forward: one pass over each sample's slabs sums the BCE and, per region, the soft Dice terms.
    Backward: a second pass writes d loss / d logits slab by slab (``_slab_logit_grad``); only one
    slab's sigmoid and targets are ever alive.

    Raises:
        SlabTooLargeError: one depth plane of the logits is already past the kernel limit.
    """
    batch, depth, num_regions = logits.shape[0], logits.shape[1], logits.shape[-1]
    slabs = _loss_slabs(logits)
    label_planes = _label_planes(labels)

    @tf.custom_gradient
    def per_sample(logits):
        logit_planes = as_planes(logits)
        sums, after = [], []
        for sample in range(batch):
            total = _LossSums(tf.zeros(()), *(tf.zeros((num_regions,)),) * 3, tf.zeros(()))
            for slab in slabs:
                with tf.control_dependencies(after):
                    total = _LossSums(*(t + term for t, term in zip(
                        total, _slab_sums(label_planes, logit_planes, member, depth, sample, slab))))
                after = list(total)
            sums.append(total)
        losses, denominators = zip(*(_sample_loss(s, num_regions) for s in sums))

        def grad(upstream):
            sample_grads = [(-2.0 / (num_regions * d), (2.0 * s.intersection + DICE_SMOOTH) / (num_regions * d * d),
                             s.voxels) for s, d in zip(sums, denominators)]
            return write_slabs(logits.shape, logits.dtype, slabs, functools.partial(
                _slab_logit_grad, label_planes, logit_planes, member, depth, sample_grads, upstream))

        return tf.stack(losses), grad

    return per_sample(logits)


def region_loss(member: np.ndarray):
    """``(labels, logits) -> (batch,)``: ``region_dice_bce_per_sample`` for these regions."""
    return functools.partial(region_dice_bce_per_sample, member=member)


def region_counts(member: np.ndarray):
    """``(labels, logits) -> (intersection, total)`` per region over the batch: the hard Dice's counts.

    A voxel is in region ``i`` where its sigmoid passes 0.5 (logit > 0), as nnU-Net paints it;
    padding is neither predicted nor true. Logits past the kernel limit are counted slab by slab.
    """
    table = tf.constant(member, tf.float32)

    def counts(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        if exceeds_limit(logits.shape):
            batch, depth = logits.shape[:2]
            logit_planes, label_planes = as_planes(logits), _label_planes(labels)
            summed = sum_slabs((2, logits.shape[-1]), batch, _loss_slabs(logits), lambda sample, slab: tf.stack(
                counts(take_planes(label_planes, depth, sample, slab.in_start, slab.in_stop)[..., 0],
                       take_planes(logit_planes, depth, sample, slab.in_start, slab.in_stop))), after=[])
            return summed[0], summed[1]
        valid = _valid(labels, tf.float32)[..., tf.newaxis]
        predicted = tf.cast(logits > 0, tf.float32) * valid
        truth = region_targets(labels, table)
        axes = (0, 1, 2, 3)
        return spatial_sum(predicted * truth, axes), spatial_sum(predicted, axes) + spatial_sum(truth, axes)

    return counts


def region_dice_from_counts(intersection: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
    """The mean hard Dice over the regions (a region absent from both prediction and truth scores 1)."""
    dice = tf.where(total > 0, 2.0 * intersection / tf.maximum(total, 1.0), 1.0)
    return tf.reduce_mean(dice)
