"""The planewise weight gradient equals TF's conv3d weight gradient, and the layer uses it only where it pays."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets import choices
from bigmem.nets.conv import Conv3D, planewise_weight_grad


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("shape, stride", [((1, 5, 6, 7, 3), 1), ((2, 4, 4, 5, 2), 1), ((1, 2, 3, 3, 4), 1),
                                           ((1, 6, 4, 8, 3), 2), ((2, 4, 6, 4, 2), 2)])
def test_planewise_weight_grad_equals_conv3d_backprop_filter(shape, stride, graph):
    rng = np.random.default_rng(0)
    out_channels = 5
    x = tf.constant(rng.normal(size=shape).astype(np.float32))
    out_spatial = tuple(size // stride for size in shape[1:4])
    dy = tf.constant(rng.normal(size=(shape[0], *out_spatial, out_channels)).astype(np.float32))
    kernel_shape = (3, 3, 3, shape[-1], out_channels)
    want = tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant(kernel_shape), out_backprop=dy,
                                             strides=[1, stride, stride, stride, 1], padding="SAME")
    fn = tf.function(planewise_weight_grad, autograph=False) if graph else planewise_weight_grad
    got = fn(x, dy, kernel_shape, stride)
    assert got.shape == kernel_shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def _grads(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.linspace(-1.0, 1.0, y.shape[-1]))
    return y, tape.gradient(loss, [x, layer.kernel])


# The planewise choices of the avx512_bf16 class, whatever CPU runs the tests.
PLANEWISE = choices.CHOICES["avx512_bf16"].planewise
LOW_1, LOW_2, LOW_2_FP32 = PLANEWISE[("bf16", 1)][0], PLANEWISE[("bf16", 2)][0], PLANEWISE[("fp32", 2)][0]
PLANEWISE_MAX_IN_CHANNELS = PLANEWISE[("bf16", 1)][1]


@pytest.fixture(autouse=True)
def avx512_bf16_choices(monkeypatch):
    monkeypatch.setattr(choices, "kernel_choices", lambda: ("avx512_bf16", choices.CHOICES["avx512_bf16"]))


@pytest.mark.parametrize("policy, strides, in_channels, planewise", [
    ("mixed_bfloat16", 1, LOW_1, True), ("mixed_bfloat16", 1, LOW_1 - 1, False),
    ("mixed_bfloat16", 1, PLANEWISE_MAX_IN_CHANNELS + 1, False),
    ("mixed_bfloat16", 2, LOW_2, True), ("float32", 2, LOW_2_FP32, True), ("float32", 2, LOW_2_FP32 - 1, False),
    ("float32", 1, LOW_1, False), ("float32", 2, PLANEWISE_MAX_IN_CHANNELS + 1, False)])
def test_layer_matches_keras_conv3d(policy, strides, in_channels, planewise):
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 6, 4, 8, in_channels)).astype(np.float32))
    ours = Conv3D(3, 3, strides=strides, padding="same", use_bias=False, dtype=policy)
    stock = keras.layers.Conv3D(3, 3, strides=strides, padding="same", use_bias=False, dtype=policy)
    for layer in (ours, stock):
        layer.build(x.shape)
    stock.kernel.assign(ours.kernel)
    assert ours._planewise(tf.cast(x, ours.compute_dtype)) is planewise
    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = _grads(ours, x), _grads(stock, x)
    assert y.dtype == ours.compute_dtype and dw.dtype == tf.float32
    # bf16 keeps 8 bits of mantissa; the kernel gradient sums over the volume in bf16 kernels.
    tol = 2e-2 if policy == "mixed_bfloat16" else 1e-5
    np.testing.assert_allclose(tf.cast(y, tf.float32), tf.cast(y_ref, tf.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(dx, dx_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(dw, dw_ref, rtol=tol, atol=tol * float(np.abs(dw_ref).max()))


def test_odd_or_tiny_strided_inputs_use_tf_kernels():
    layer = Conv3D(2, 3, strides=2, padding="same")
    layer.build((1, 6, 6, 6, LOW_2_FP32))
    assert layer._planewise(tf.zeros((1, 6, 6, 6, LOW_2_FP32)))
    assert not layer._planewise(tf.zeros((1, 5, 6, 6, LOW_2_FP32)))  # TF pads odd sizes differently
    assert not layer._planewise(tf.zeros((1, 2, 6, 6, LOW_2_FP32)))  # one output plane
