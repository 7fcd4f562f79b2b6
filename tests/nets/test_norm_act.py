"""The fused norm+activation computes what Keras's GroupNormalization + activation compute."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from bigmem.nets.norm_act import NormActivation
from helpers import slab_calls

REFERENCE_ACTIVATIONS = {
    "relu": lambda dtype: keras.layers.ReLU(dtype=dtype),
    "leaky_relu": lambda dtype: keras.layers.LeakyReLU(negative_slope=0.01, dtype=dtype),
    "linear": lambda dtype: keras.layers.Activation("linear", dtype=dtype),
}
# float32 agrees to rounding; bfloat16 keeps 8 bits of mantissa (relative step 2^-8 = 0.004).
TOLERANCE = {"float32": 1e-5, "mixed_bfloat16": 3e-2}
# Under bf16 the pre-activation is rounded to bf16 before its sign is tested, so an element
# right at the kink may take the other slope than in the float32 reference. The upstream
# gradient is zeroed within KINK_BAND of the kink (in the reference's normalised units), so a
# flipped element carries no gradient and every other value must agree to bf16 precision.
KINK_BAND = 0.05
KINK_FRACTION = {"float32": 0.0, "mixed_bfloat16": 0.005}


def _assert_close(got, want, tol, allowed_fraction):
    got = np.asarray(tf.cast(got, tf.float32))
    want = np.asarray(tf.cast(want, tf.float32))
    outside = np.abs(got - want) > tol * max(float(np.abs(want).max()), 1e-12)
    assert outside.mean() <= allowed_fraction, (outside.sum(), outside.size)


def _run(layer_fn, x, weights, variables, graph=False):
    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer_fn(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        return y, tape.gradient(loss, [x, *variables])
    # In a tf.function TF's graph passes may swap kernels (oneDNN's batch norm for the 4-D
    # FusedBatchNormV3), so both execution modes are checked.
    return tf.function(forward_backward)(x) if graph else forward_backward(x)


# 4 channels: group norm, and instance norm on the 5-D kernel; 16: instance norm on oneDNN's 4-D kernel.
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("groups, activation, channels", [
    (-1, "relu", 4), (2, "leaky_relu", 4), (-1, "linear", 4), (4, "relu", 4), (-1, "leaky_relu", 4),
    (-1, "relu", 8),  # bf16: oneDNN's float32 kernel between casts (_fused_batch_norm_float32)
    (-1, "relu", 16), (-1, "leaky_relu", 16), (-1, "linear", 16)])
def test_matches_keras_group_norm(policy, groups, activation, channels, graph):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(1.0, 3.0, (2, 5, 6, 7, channels)).astype(np.float32))
    weights = tf.constant(rng.normal(size=x.shape).astype(np.float32))
    gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, channels).astype(np.float32)
    fused = NormActivation(groups=groups, activation=activation, dtype=policy)
    # The reference is Keras's float32 math: under bf16 the fused layer must approximate it to bf16 precision.
    norm = keras.layers.GroupNormalization(groups=groups, epsilon=1e-5, dtype="float32")
    act = REFERENCE_ACTIVATIONS[activation]("float32")
    for layer in (fused, norm):
        layer.build(x.shape)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    if activation != "linear":
        weights = weights * tf.cast(tf.abs(norm(x)) > KINK_BAND, tf.float32)
    y_fused, g_fused = _run(fused, x, weights, [fused.gamma, fused.beta], graph)
    y_ref, g_ref = _run(lambda t: act(norm(t)), x, weights, [norm.gamma, norm.beta])
    assert y_fused.dtype == ("bfloat16" if policy == "mixed_bfloat16" else "float32")
    tol, kink = TOLERANCE[policy], KINK_FRACTION[policy]
    _assert_close(y_fused, y_ref, tol, kink)
    for got, want in zip(g_fused, g_ref):
        _assert_close(got, want, tol, 0.0)


def test_zero_init_and_config_round_trip():
    layer = NormActivation(groups=2, activation="leaky_relu", zero_init=True)
    layer.build((None, 4, 4, 4, 4))
    np.testing.assert_array_equal(np.asarray(layer.gamma), 0.0)
    again = NormActivation.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()


def test_rejects_unknown_activation_and_bad_groups():
    with pytest.raises(ValueError, match="activation 'gelu' is not one of"):
        NormActivation(activation="gelu")
    with pytest.raises(ValueError, match="6 channels cannot be split into 4 groups"):
        NormActivation(groups=4).build((None, 4, 4, 4, 6))


def test_volumes_past_the_fused_norms_accuracy_use_the_slab_statistics():
    """Past FUSED_NORM_MAX_VOXELS per sample oneDNN's batch norm statistics drift; slab sums are exact."""
    import numpy as np
    import tensorflow as tf

    from bigmem.nets import norm_act
    from bigmem.nets.norm_act import NormActivation

    layer = NormActivation(activation="linear")
    x = tf.random.stateless_uniform((1, 64, 64, 64, 8), seed=[1, 2]) + 3.0
    layer.build(x.shape)
    calls = []
    original = norm_act.norm_activation_large
    try:
        norm_act.norm_activation_large = lambda *a, **k: calls.append(1) or original(*a, **k)
        norm_act.FUSED_NORM_MAX_VOXELS = 64**3 - 1
        y = layer(x, training=True)
    finally:
        norm_act.norm_activation_large = original
        norm_act.FUSED_NORM_MAX_VOXELS = 2**23
    assert calls == [1]
    centred = y.numpy().reshape(-1, 8)
    np.testing.assert_allclose(centred.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(centred.std(axis=0), 1.0, atol=1e-3)


@pytest.mark.parametrize("slabs", [False, True], ids=["fused", "slabs"])
@pytest.mark.parametrize("channels", [4, 16])
def test_mixed_bfloat16_normalises_with_float32_gamma_and_beta(slabs, channels):
    """beta = -0.999 is -1.0 in bfloat16: with it, xhat = +1 would be gated off and dbeta would be 0.

    x is +1 / -1 in alternating voxels: mean 0, variance 1, so xhat = +-1 / sqrt(1 + eps) and
    z = xhat - 0.999 is +0.001 on the +1 voxels: exactly half the voxels pass the ReLU.
    """
    from bigmem.nets.slabs import kernel_element_limit

    shape = (1, 8, 8, 8, channels)
    sign = np.where(np.indices(shape[1:4]).sum(axis=0) % 2 == 0, 1.0, -1.0)
    x = tf.constant(np.broadcast_to(sign[None, ..., None], shape), tf.float32)
    layer = NormActivation(dtype="mixed_bfloat16")
    layer.build(shape)
    layer.beta.assign(np.full(channels, -0.999, np.float32))
    with kernel_element_limit(2 * 8 * 8 * channels if slabs else 2**30), slab_calls() as calls:
        with tf.GradientTape() as tape:
            y = layer(x)
        dbeta = tape.gradient(y, layer.beta, output_gradients=tf.ones_like(y))
    assert calls == ({"norm_activation": 1} if slabs else {})
    assert layer.beta.dtype == "float32"
    assert np.asarray(layer.beta)[0] == np.float32(-0.999)
    np.testing.assert_array_equal(dbeta.numpy(), np.full(channels, 8**3 / 2))
    positive = tf.cast(y, tf.float32).numpy()[..., 0][sign[None] > 0]
    np.testing.assert_allclose(positive, 1.0 / np.sqrt(1 + 1e-5) - 0.999, rtol=2e-2)


def test_bfloat16_with_eight_channels_runs_the_float32_kernel(monkeypatch):
    from bigmem.nets import norm_act

    calls = []
    original = norm_act._fused_batch_norm_float32
    monkeypatch.setattr(norm_act, "_fused_batch_norm_float32", lambda *a: calls.append(a[0].dtype) or original(*a))
    x = tf.cast(tf.random.stateless_normal((1, 4, 4, 4, 8), [1, 2]), tf.bfloat16)
    y = norm_act.instance_norm_activation(x, tf.ones(8), tf.zeros(8), epsilon=1e-5, activation="relu",
                                          negative_slope=0.0)
    assert calls == [tf.bfloat16]
    assert y.dtype == tf.bfloat16
    norm_act.instance_norm_activation(tf.cast(x, tf.float32), tf.ones(8), tf.zeros(8), epsilon=1e-5,
                                      activation="relu", negative_slope=0.0)
    assert calls == [tf.bfloat16]  # float32 with 8 channels takes oneDNN's float32 kernel directly


@pytest.mark.parametrize("shape, groups, activation, dtype", [
    ((1, 9, 6, 5, 16), 16, "relu", "float32"), ((2, 7, 4, 4, 8), 4, "leaky_relu", "float32"),
    ((1, 8, 6, 6, 4), 2, "linear", "float32"), ((1, 9, 6, 6, 16), 16, "relu", "bfloat16")])
def test_large_volume_norm_equals_fused_norm(shape, groups, activation, dtype):
    """norm_activation_large (slab sums, fused elementwise kernels) against the float32 fused norm."""
    from bigmem.nets import norm_act

    rng = np.random.default_rng(3)
    x = tf.cast(tf.constant(rng.normal(2.0, 1.5, shape).astype(np.float32)), dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
    beta = tf.constant(rng.normal(0, 0.3, shape[-1]).astype(np.float32))
    weights = tf.constant(rng.normal(size=shape).astype(np.float32))
    options = dict(groups=groups, epsilon=1e-5, activation=activation, negative_slope=0.01)

    def run(fn, x):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y = fn(x, gamma, beta, **options)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        return [y, *tape.gradient(loss, [x, gamma, beta])]

    saved = norm_act.NORM_SLAB_ELEMENTS
    norm_act.NORM_SLAB_ELEMENTS = 2 * math.prod(shape[2:])  # two planes a slab: several slabs and a rest
    try:
        got = run(norm_act.norm_activation_large, x)
    finally:
        norm_act.NORM_SLAB_ELEMENTS = saved
    want = run(norm_act.fused_norm_activation, tf.cast(x, tf.float32))
    tol = 1e-4 if dtype == "float32" else 3e-2
    for name, a, b in zip(("y", "dx", "dgamma", "dbeta"), got, want):
        a, b = tf.cast(a, tf.float32).numpy(), tf.cast(b, tf.float32).numpy()
        # bf16: a pre-activation within rounding of 0 may take the other slope; allow a few such elements
        outside = np.abs(a - b) > tol * max(np.abs(b).max(), 1e-6)
        assert outside.mean() <= (0.0 if dtype == "float32" else 0.01), (name, np.abs(a - b).max())


def test_a_plane_past_the_limit_is_refused_by_the_slab_norm():
    from bigmem.nets.limits import kernel_element_limit
    from bigmem.nets.norm_act import norm_activation_slabs
    from bigmem.nets.slabplan import SlabTooLargeError

    x = tf.ones((1, 4, 4, 4, 2))
    with kernel_element_limit(4 * 4 * 2 - 1), pytest.raises(
            SlabTooLargeError, match=r"group norm on \(1, 4, 4, 4, 2\): a single depth plane exceeds the kernel "
                                     r"limit of 31 elements"):
        norm_activation_slabs(x, tf.ones(2), tf.zeros(2), groups=2, epsilon=1e-5, activation="relu",
                              negative_slope=0.0)
