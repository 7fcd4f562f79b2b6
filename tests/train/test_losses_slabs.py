"""The loss and Dice counts in depth slabs equal the whole-tensor ones (values and gradients)."""

import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets.limits import kernel_element_limit
from bigmem.train.losses import dice_ce_per_sample, dice_ce_per_sample_slabs, dice_counts


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
    with kernel_element_limit(shape[2] * shape[3] * shape[4] * 4):
        got_loss, got_grad = value_and_grad(dice_ce_per_sample)  # dispatches to the slab version
        counts = dice_counts(labels, logits)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6 * float(tf.reduce_max(tf.abs(want_grad))) + 1e-9)
    for got, want in zip(counts, dice_counts(labels, logits)):
        np.testing.assert_array_equal(got, want)


def test_loss_in_slabs_inside_a_graph():
    logits = tf.random.stateless_normal((1, 12, 3, 3, 3), seed=[5, 6])
    labels = tf.zeros((1, 12, 3, 3), tf.uint8)
    with kernel_element_limit(3 * 3 * 3 * 3):
        graph_loss = tf.function(dice_ce_per_sample_slabs)(labels, logits)
    np.testing.assert_allclose(graph_loss, dice_ce_per_sample(labels, logits), rtol=1e-5)


def test_a_plane_past_the_limit_is_refused_by_the_slab_loss():
    from bigmem.nets.slabplan import SlabTooLargeError

    logits = tf.zeros((1, 4, 3, 3, 2))
    with kernel_element_limit(3 * 3 * 2 - 1), pytest.raises(
            SlabTooLargeError, match=r"the loss on \(1, 4, 3, 3, 2\): a single depth plane exceeds the kernel limit "
                                     r"of 17 elements"):
        dice_ce_per_sample_slabs(tf.zeros((1, 4, 3, 3), tf.uint8), logits)
