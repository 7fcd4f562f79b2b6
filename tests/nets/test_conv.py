"""The planewise weight gradient equals TF's conv3d weight gradient, and the layer uses it only where it pays."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets import choices
from bigmem.nets import conv as conv_module
from bigmem.nets.conv import Conv3D, Conv3DTranspose, planewise_weight_grad, pointwise_weight_grad, \
    transposed_weight_grad
from helpers import slab_calls


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
    assert y.dtype == ours.compute_dtype
    assert dw.dtype == tf.float32
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


def test_pointwise_weight_grad_equals_conv3d_backprop_filter():
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(2, 3, 4, 5, 6)).astype(np.float32))
    dy = tf.constant(rng.normal(size=(2, 3, 4, 5, 3)).astype(np.float32))
    want = tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant([1, 1, 1, 6, 3]), out_backprop=dy,
                                             strides=[1] * 5, padding="SAME")
    got = pointwise_weight_grad(x, dy)
    assert got.shape == (1, 1, 1, 6, 3)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("shape, stride, chunks", [((1, 5, 3, 4, 4), 2, 2), ((2, 3, 2, 2, 3), 2, 8),
                                                   ((1, 4, 2, 3, 2), 3, 3)])
def test_transposed_weight_grad_equals_conv3d_backprop_filter(shape, stride, chunks, graph, monkeypatch):
    """Uneven depth chunks, more chunks than planes, two samples and k = 3 all give TF's kernel gradient."""
    monkeypatch.setattr(conv_module, "TRANSPOSED_GRAD_CHUNKS", chunks)
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=shape).astype(np.float32))
    dy = tf.constant(rng.normal(size=(shape[0], *(stride * s for s in shape[1:4]), 5)).astype(np.float32))
    k = stride
    want = tf.raw_ops.Conv3DBackpropFilterV2(input=dy, filter_sizes=tf.constant([k, k, k, 5, shape[-1]]),
                                             out_backprop=x, strides=[1, k, k, k, 1], padding="SAME")
    fn = tf.function(transposed_weight_grad, autograph=False) if graph else transposed_weight_grad
    got = fn(dy, x, stride)
    assert got.shape == (k, k, k, 5, shape[-1])
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_d_others(monkeypatch):
    """A class whose 1x1x1 and transposed weight gradients are 2-D in fp32, as AMX's are in bf16."""
    table = choices.KernelChoices(planewise_others=frozenset({"fp32"}), source="test")
    monkeypatch.setattr(choices, "kernel_choices", lambda: ("test", table))
    calls = []
    for name in ("pointwise_weight_grad", "transposed_weight_grad"):
        original = getattr(conv_module, name)
        monkeypatch.setattr(conv_module, name,
                            lambda *args, original=original, name=name: calls.append(name) or original(*args))
    return calls


def test_pointwise_layer_takes_the_2d_weight_gradient_and_matches_keras(two_d_others):
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(2, 4, 5, 6, 8)).astype(np.float32))
    ours, stock = Conv3D(3, 1, use_bias=True), keras.layers.Conv3D(3, 1, use_bias=True)
    for layer in (ours, stock):
        layer.build(x.shape)
    stock.set_weights(ours.get_weights())
    assert ours._pointwise(x)
    assert not ours._planewise(x)
    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = _grads(ours, x), _grads(stock, x)
    assert two_d_others == ["pointwise_weight_grad"]
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not Conv3D(3, 1, strides=2)._pointwise(x)  # strided 1x1x1: TF's own


@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "slabs"])
def test_transposed_layer_takes_the_2d_weight_gradient_and_matches_keras(two_d_others, partitioned):
    from bigmem.nets.slabs import MAX_KERNEL_ELEMENTS, kernel_element_limit

    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(1, 7, 3, 4, 6)).astype(np.float32))
    ours = Conv3DTranspose(4, 2, strides=2, padding="same")
    stock = keras.layers.Conv3DTranspose(4, 2, strides=2, padding="same")
    for layer in (ours, stock):
        layer.build(x.shape)
    stock.set_weights(ours.get_weights())
    # Slabs: two input planes' outputs (4 output planes of 6 x 8 x 4) per slab.
    with kernel_element_limit(4 * 6 * 8 * 4 if partitioned else MAX_KERNEL_ELEMENTS), slab_calls() as calls:
        (y, (dx, dw)) = _grads(ours, x)
    y_ref, (dx_ref, dw_ref) = _grads(stock, x)
    assert calls == ({"conv3d_transpose": 1} if partitioned else {})
    assert two_d_others == ["transposed_weight_grad"] * (4 if partitioned else 1)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_channels", [32, 64, 256])
@pytest.mark.parametrize("spatial", [(2, 1, 1), (2, 2, 2), (2, 8, 8)])
def test_a_bf16_input_two_planes_deep_takes_the_planewise_gradient(spatial, in_channels):
    """oneDNN's bf16 3-D weight gradient was 85-120% off float32's here on an avx512_bf16 EPYC (and sometimes
    inf): the layer takes the planewise one whatever the choice table says, and lands within bf16's rounding."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(1, *spatial, in_channels)).astype(np.float32))
    ours = Conv3D(in_channels, 3, padding="same", use_bias=False, dtype="mixed_bfloat16")
    exact = keras.layers.Conv3D(in_channels, 3, padding="same", use_bias=False, dtype="float32")
    for layer in (ours, exact):
        layer.build(x.shape)
    exact.kernel.assign(ours.kernel)
    assert ours._planewise(tf.cast(x, tf.bfloat16)) is True
    with conv_module.observe_convolutions() as calls:
        _, (_, dw) = _grads(ours, x)
    assert [call.path for call in calls] == ["planewise"]
    _, (_, dw_exact) = _grads(exact, tf.cast(tf.cast(x, tf.bfloat16), tf.float32))
    assert float(tf.norm(dw - dw_exact) / tf.norm(dw_exact)) < 1e-2
