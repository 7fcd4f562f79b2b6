"""The planewise weight gradient equals TF's conv3d weight gradient, and the layer uses it only where it pays."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets.conv import PLANEWISE_MAX_IN_CHANNELS, Conv3D, planewise_weight_grad


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("shape", [(1, 5, 6, 7, 3), (2, 4, 4, 5, 2), (1, 2, 3, 3, 4)])
def test_planewise_weight_grad_equals_conv3d_backprop_filter(shape, graph):
    rng = np.random.default_rng(0)
    out_channels = 5
    x = tf.constant(rng.normal(size=shape).astype(np.float32))
    dy = tf.constant(rng.normal(size=(*shape[:4], out_channels)).astype(np.float32))
    kernel_shape = (3, 3, 3, shape[-1], out_channels)
    want = tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant(kernel_shape), out_backprop=dy,
                                             strides=[1] * 5, padding="SAME")
    fn = tf.function(planewise_weight_grad, autograph=False) if graph else planewise_weight_grad
    got = fn(x, dy, kernel_shape)
    assert got.shape == kernel_shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def _grads(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.linspace(-1.0, 1.0, y.shape[-1]))
    return y, tape.gradient(loss, [x, layer.kernel])


@pytest.mark.parametrize("in_channels, planewise", [(4, True), (PLANEWISE_MAX_IN_CHANNELS + 1, False)])
def test_layer_matches_keras_conv3d_under_bf16(in_channels, planewise):
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(1, 6, 5, 4, in_channels)).astype(np.float32))
    ours = Conv3D(3, 3, padding="same", use_bias=False, dtype="mixed_bfloat16")
    stock = keras.layers.Conv3D(3, 3, padding="same", use_bias=False, dtype="mixed_bfloat16")
    for layer in (ours, stock):
        layer.build(x.shape)
    stock.kernel.assign(ours.kernel)
    assert ours._planewise(tf.cast(x, tf.bfloat16), ours.kernel) is planewise
    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = _grads(ours, x), _grads(stock, x)
    assert y.dtype == tf.bfloat16 and dw.dtype == tf.float32
    np.testing.assert_allclose(tf.cast(y, tf.float32), tf.cast(y_ref, tf.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dx, dx_ref, rtol=2e-2, atol=2e-2)
    # The kernel gradient sums over the volume in bf16 kernels: compare at bf16's relative precision.
    np.testing.assert_allclose(dw, dw_ref, rtol=2e-2, atol=2e-2 * float(np.abs(dw_ref).max()))


def test_float32_and_strided_convs_use_tf_kernels():
    x = tf.zeros((1, 4, 4, 4, 2), tf.float32)
    layer = Conv3D(2, 3, padding="same")
    layer.build(x.shape)
    assert not layer._planewise(x, layer.kernel)
    strided = Conv3D(2, 3, strides=2, padding="same", dtype="mixed_bfloat16")
    strided.build(x.shape)
    assert not strided._planewise(tf.cast(x, tf.bfloat16), strided.kernel)
