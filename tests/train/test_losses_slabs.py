"""The loss and Dice counts in depth slabs equal the whole-tensor ones (values and gradients)."""

import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets.limits import kernel_element_limit
from bigmem.train.losses import dice_ce_per_sample, dice_ce_per_sample_slabs, dice_counts
from helpers import slab_calls


def _argmax_ops(labels, logits) -> int:
    """ArgMax ops in dice_counts's graph: one for the whole tensor, one per slab past the limit."""
    graph = tf.function(dice_counts).get_concrete_function(labels, logits).graph
    return sum(op.type == "ArgMax" for op in graph.get_operations())


@pytest.mark.parametrize("shape", [(1, 33, 4, 5, 3), (2, 17, 3, 3, 4), (1, 9, 2, 2, 2)])
def test_loss_in_slabs_equals_whole(shape):
    logits = tf.random.stateless_normal(shape, seed=[1, 2]) * 3
    labels = tf.cast(tf.random.stateless_uniform(shape[:-1], seed=[3, 4], maxval=shape[-1], dtype=tf.int32),
                     tf.uint8)
    upstream = tf.constant([1.0, -2.0][:shape[0]])

    def value_and_grad(fn):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = fn(labels, logits)
            total = tf.reduce_sum(loss * upstream)
        return loss, tape.gradient(total, logits)

    want_loss, want_grad = value_and_grad(dice_ce_per_sample)
    assert _argmax_ops(labels, logits) == 1
    with kernel_element_limit(shape[2] * shape[3] * shape[4] * 4), slab_calls() as calls:
        got_loss, got_grad = value_and_grad(dice_ce_per_sample)  # dispatches to the slab version
        counts = dice_counts(labels, logits)
        counted_in_slabs = _argmax_ops(labels, logits)
    assert calls == {"loss": 1}
    assert counted_in_slabs > 1  # dice_counts has no counter: its trace shows the slabs
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6 * float(tf.reduce_max(tf.abs(want_grad))) + 1e-9)
    for got, want in zip(counts, dice_counts(labels, logits)):
        np.testing.assert_array_equal(got, want)


def test_loss_in_slabs_inside_a_graph():
    logits = tf.random.stateless_normal((1, 12, 3, 3, 3), seed=[5, 6])
    labels = tf.zeros((1, 12, 3, 3), tf.uint8)
    with kernel_element_limit(3 * 3 * 3 * 3), slab_calls() as calls:
        graph_loss = tf.function(dice_ce_per_sample_slabs)(labels, logits)
    assert calls == {"loss": 1}
    np.testing.assert_allclose(graph_loss, dice_ce_per_sample(labels, logits), rtol=1e-5)


def test_a_plane_past_the_limit_is_refused_by_the_slab_loss():
    from bigmem.nets.slabplan import SlabTooLargeError

    logits = tf.zeros((1, 4, 3, 3, 2))
    with kernel_element_limit(3 * 3 * 2 - 1), pytest.raises(
            SlabTooLargeError, match=r"the loss on \(1, 4, 3, 3, 2\): a single depth plane exceeds the kernel limit "
                                     r"of 17 elements"):
        dice_ce_per_sample_slabs(tf.zeros((1, 4, 3, 3), tf.uint8), logits)


def test_deep_supervision_runs_in_slabs_past_the_limit_and_equals_whole():
    """A deep-supervised network and its loss with the kernel limit lowered below every level-0 and level-1
    tensor: the heads' convolutions and the full-resolution loss take the slab path, and the loss and the
    gradients equal the unpartitioned ones."""
    from bigmem.nets.limits import SLAB_CALLS
    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.losses import supervised

    model = UNet3D({"depth": 3, "base_filters": 4, "num_classes": 3, "deep_supervision": True}).build_for()
    images = tf.random.stateless_normal((1, 32, 8, 8, 1), seed=[7, 8])
    labels = tf.cast(tf.random.stateless_uniform((1, 32, 8, 8), seed=[9, 10], maxval=3, dtype=tf.int32), tf.uint8)
    loss_fn = supervised(dice_ce_per_sample)

    def loss_and_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(labels, model(images, training=True)))
        return loss, tape.gradient(loss, model.trainable_variables)

    want_loss, want_grads = loss_and_grads()
    before = SLAB_CALLS.copy()
    with kernel_element_limit(2000):  # level 0: 32x8x8 x 4 = 8192; level 1: 16x4x4 x 8 = 2048 (head1's input)
        got_loss, got_grads = loss_and_grads()
    calls = SLAB_CALLS - before
    assert calls["conv3d"] > 0
    assert calls["loss"] > 0  # the full-resolution loss (32x8x8 x 3 = 6144 logits)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    head1 = [i for i, v in enumerate(model.trainable_variables) if "head1" in v.path]
    assert head1
    for i in head1:
        np.testing.assert_allclose(got_grads[i], want_grads[i], rtol=1e-4, atol=1e-6)
