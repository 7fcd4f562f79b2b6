"""Instance/group normalisation fused with its activation, keeping only its input for backward.

Keras's GroupNormalization followed by ReLU keeps several full-size intermediates per conv
unit for the backward pass (the centred input, the normalised input, the scaled output, the
activation output), in float32 even under mixed_bfloat16, and runs about ten full-size
elementwise passes each way. ``NormActivation`` computes the same function two ways:

- instance norm (one group per channel): one ``FusedBatchNormV3`` per sample on the sample
  viewed as 4-D (1, D, H*W, C) (a sample's "batch" statistics are its instance statistics),
  then the activation. TF's oneDNN pass runs the 4-D op as oneDNN's batch normalisation and its
  remapper fuses a following ReLU into it. It keeps the input and the output, in the compute
  dtype, and is the fastest of the three forms (timings: benchmarks/results/kernels.md).
- group norm: a custom gradient that keeps only the input (in the compute dtype) and the
  per-(sample, group) mean and reciprocal standard deviation, and recomputes the rest in
  backward.

Statistics and gradients are computed in float32 either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import keras
import tensorflow as tf

from bigmem.nets.reduce import spatial_sum
from bigmem.nets.limits import counted
from bigmem.nets.slabplan import planes_per_slab
from bigmem.nets.slabs import as_planes, exceeds_limit

ACTIVATIONS = ("relu", "leaky_relu", "linear")
# Channel counts oneDNN's batch norm vectorises for channels-last data (AVX-512: 16 lanes; its
# float32 kernel also has an AVX2 form with 8), by dtype; checked with ONEDNN_VERBOSE.
ONEDNN_NORM_CHANNEL_MULTIPLE = {"float32": 8, "bfloat16": 16}
# The most voxels per sample FusedBatchNormV3 (oneDNN, TF 2.21) normalises correctly: its float32
# statistics accumulate linearly per channel and drift past this (measurement:
# benchmarks/results/kernels.md). Larger samples (kits19 from 224^3) use norm_activation_large,
# whose sums run over small slabs, one spatial axis at a time, in float32 (nets/reduce.py).
FUSED_NORM_MAX_VOXELS = 2**23
# The slab norm's slabs: its temporaries are float32 and several live at once, so conv-sized
# slabs (2^29 elements) ran past the memory plan (benchmarks/results/kernels.md). It needs no
# halo, so its slabs are small, run as a tf.while_loop: 2^22 elements (16 MiB in float32), one
# plane where a plane is more.
NORM_SLAB_ELEMENTS = 2**22


def _grouped(x: tf.Tensor, groups: int) -> tf.Tensor:
    """(B, D, H, W, C) -> (B, D*H*W, G, C/G)."""
    shape = tf.shape(x)
    channels = x.shape[-1]
    return tf.reshape(x, tf.stack([shape[0], -1, groups, channels // groups]))


def _channel_sums(t: tf.Tensor, like: tf.Tensor | None, groups: int) -> tf.Tensor:
    """Sums over space per (sample, channel) as (B, 1, G, C/G), float32; ``t`` is 5-D or shaped like ``like``.

    One spatial axis at a time (nets/reduce.py): TF's one-step sum saturates past 2^24 terms
    when fewer than 8 channels remain.
    """
    if like is not None:
        t = tf.reshape(t, tf.shape(like))
    sums = spatial_sum(t)  # (B, C)
    channels = t.shape[-1]
    return tf.reshape(sums, tf.stack([tf.shape(sums)[0], 1, groups, channels // groups]))


def _group_sums(t: tf.Tensor, groups: int) -> tf.Tensor:
    """Sums over space and each group's channels of a 5-D tensor, as (B, 1, G, 1)."""
    return tf.reduce_sum(_channel_sums(t, None, groups), axis=3, keepdims=True)


def _per_channel(per_group: tf.Tensor, channels_per_group: int) -> tf.Tensor:
    """(B, 1, G, 1) -> (B, 1, 1, 1, C): a group statistic for each of its channels, to broadcast over 5-D."""
    repeated = tf.repeat(per_group, channels_per_group, axis=2)  # (B, 1, C, 1)
    return tf.reshape(repeated, tf.stack([tf.shape(per_group)[0], 1, 1, 1, -1]))


def _input_grad_coefficients(g, mean, rstd, sum_dz, sum_dz_x, count):
    """dgamma, dbeta and (k1, k2, k3) with dx = k1 * dz + k2 * x + k3, per (sample, group, channel).

    Args:
        g: gamma as (1, 1, G, Cg); mean, rstd: (B, 1, G, 1) statistics of x.
        sum_dz, sum_dz_x: sums over space of dz and dz * x, (B, 1, G, Cg), float32.
        count: elements per (sample, group).
    """
    channels = g.shape[2] * g.shape[3]
    sum_dz_xhat = rstd * (sum_dz_x - mean * sum_dz)  # sum of dz * xhat per (sample, channel)
    dgamma = tf.reshape(tf.reduce_sum(sum_dz_xhat, axis=0), (channels,))
    dbeta = tf.reshape(tf.reduce_sum(sum_dz, axis=0), (channels,))
    count = tf.cast(count, tf.float32)
    mean_dxhat = tf.reduce_sum(g * sum_dz, axis=3, keepdims=True) / count  # (B, 1, G, 1)
    mean_dxhat_xhat = tf.reduce_sum(g * sum_dz_xhat, axis=3, keepdims=True) / count
    # dx = rstd * (g dz - mean(g dz) - xhat mean(g dz xhat)), with xhat = (x - mean) rstd
    k1 = rstd * g
    k2 = -rstd * rstd * mean_dxhat_xhat
    k3 = rstd * rstd * mean_dxhat_xhat * mean - rstd * mean_dxhat
    return dgamma, dbeta, (k1, k2, k3)


def _activate(z, activation: str, negative_slope: float):
    if activation == "relu":
        return tf.nn.relu(z)
    if activation == "leaky_relu":
        return tf.nn.leaky_relu(z, alpha=negative_slope)
    return z


def _gate(dy, z, activation: str, negative_slope: float):
    """The activation's backward: dy where z > 0, else dy times the slope (0 for ReLU)."""
    if activation == "linear":
        return dy
    slope = negative_slope if activation == "leaky_relu" else 0.0
    return tf.where(z > tf.zeros((), z.dtype), dy, dy * tf.cast(slope, dy.dtype))


def fused_norm_activation(x, gamma, beta, *, groups: int, epsilon: float, activation: str, negative_slope: float):
    """act(gamma * (x - mean) / sqrt(var + eps) + beta), stats over space and each channel group.

    Statistics and every reduction are float32; the full-size elementwise work runs in x's dtype
    (bfloat16 under mixed precision), written as an affine map per (sample, channel): forward
    y = act(x * scale + shift); backward dx = k1 * dz + k2 * x + k3, so only a few tensors of
    x's size and dtype are ever live (a custom gradient that keeps only x).

    Args:
        x: ``(batch, D, H, W, C)``, C static and divisible by ``groups``; any float dtype.
        gamma, beta: ``(C,)`` float32 scale and offset.
        groups: channel groups (C for instance norm, 1 for layer norm).
        epsilon: added to the variance.
        activation: one of ``ACTIVATIONS``.
        negative_slope: the leaky ReLU's slope for negative inputs (ignored otherwise).

    Returns:
        ``(batch, D, H, W, C)`` in x's dtype.
    """
    channels = x.shape[-1]
    per_group = channels // groups
    dtype = x.dtype

    @tf.custom_gradient
    def forward(x, gamma, beta):
        xg = _grouped(x, groups)
        count = tf.cast(tf.reduce_prod(tf.shape(x)[1:4]) * per_group, tf.float32)
        mean = _group_sums(tf.cast(x, tf.float32), groups) / count  # (B, 1, G, 1)
        var = _group_sums(tf.math.squared_difference(tf.cast(x, tf.float32), _per_channel(mean, per_group)),
                          groups) / count
        rstd = tf.math.rsqrt(var + epsilon)
        g = tf.reshape(gamma, (1, 1, groups, per_group))
        b = tf.reshape(beta, (1, 1, groups, per_group))
        scale = g * rstd  # (B, 1, G, Cg)
        shift = b - scale * mean
        z = _activate(xg * tf.cast(scale, dtype) + tf.cast(shift, dtype), activation, negative_slope)
        y = tf.reshape(z, tf.shape(x))

        def backward(dy):
            # The recomputation must wait for dy: without this edge the graph executor may run
            # it as soon as the forward values exist, keeping its results alive as if stored.
            with tf.control_dependencies([dy]):
                x_again = _grouped(tf.identity(x), groups)
            dz = _gate(_grouped(dy, groups), x_again * tf.cast(scale, dtype) + tf.cast(shift, dtype), activation,
                       negative_slope)
            # One float32 temporary at a time: the second reduction waits for the first, so the
            # inter-op pool cannot run both (each with a full-size float32 copy) at once.
            sum_dz = _channel_sums(tf.cast(dz, tf.float32), x, groups)  # (B, 1, G, Cg)
            with tf.control_dependencies([sum_dz]):
                sum_dz_x = _channel_sums(tf.cast(dz * x_again, tf.float32), x, groups)
            dgamma, dbeta, (k1, k2, k3) = _input_grad_coefficients(g, mean, rstd, sum_dz, sum_dz_x,
                                                                   tf.shape(dz)[1] * per_group)
            dx = dz * tf.cast(k1, dtype) + x_again * tf.cast(k2, dtype) + tf.cast(k3, dtype)
            return tf.reshape(dx, tf.shape(x)), dgamma, dbeta

        return y, backward

    return forward(x, gamma, beta)


@dataclass(frozen=True)
class _SlabNorm:
    """One group norm + activation as its slab passes share it: the input's shape, the options, planes per slab.

    Args:
        shape: the input's static ``(batch, D, H, W, C)``.
        groups, epsilon, activation, negative_slope: as ``fused_norm_activation``.
        planes: depth planes per slab of the passes (``slabplan.planes_per_slab``).
    """

    shape: tuple[int, ...]
    groups: int
    epsilon: float
    activation: str
    negative_slope: float
    planes: int

    @property
    def depth(self) -> int:
        """Depth planes per sample."""
        return self.shape[1]

    @property
    def per_group(self) -> int:
        """Channels per group."""
        return self.shape[4] // self.groups

    @property
    def count(self) -> int:
        """Elements per (sample, group)."""
        return self.shape[1] * self.shape[2] * self.shape[3] * self.per_group


def _slab_norm(x, groups: int, epsilon: float, activation: str, negative_slope: float) -> _SlabNorm:
    """The ``_SlabNorm`` of ``x``: slabs of at most NORM_SLAB_ELEMENTS (one plane where a plane is more).

    Raises:
        SlabTooLargeError: one depth plane of ``x`` is already past the kernel limit.
    """
    shape = tuple(int(s) for s in x.shape)
    planes = planes_per_slab(shape, what=f"group norm on {shape}", target=NORM_SLAB_ELEMENTS)
    return _SlabNorm(shape, groups, float(epsilon), activation, negative_slope, planes)


class _Moments(NamedTuple):
    """One sample's statistics per group, (1, 1, G, 1) float32, and per channel, (C,), as fused kernels take them."""

    group_mean: tf.Tensor
    group_variance: tf.Tensor
    mean: tf.Tensor
    variance: tf.Tensor


def _slab_ranges(depth: int, planes: int) -> list[tuple[int, int, int]]:
    """(first plane, slab count, planes per slab): whole slabs of ``planes`` as one loop, the rest as another."""
    whole, rest = divmod(depth, planes)
    return [r for r in ((0, whole, planes), (whole * planes, 1 if rest else 0, rest)) if r[1]]


def _rows_at(rows, row, planes: int):
    """``planes`` rows of ``as_planes`` rows from ``row`` (a runtime index), as a (1, planes, H, W, C) slab."""
    return tf.expand_dims(tf.slice(rows, tf.stack([row, 0, 0, 0]), [planes, -1, -1, -1]), 0)


def _over_slabs(rows, norm: _SlabNorm, sample: int, body, state):
    """``state = body(first_row, slab, state)`` for each slab of one sample, in order, as tf.while_loops.

    ``slab`` is (1, n, H, W, C) read from ``rows`` (``as_planes``) at runtime, ``first_row`` its row.
    A while_loop holds one slab's temporaries at a time and puts one copy of the body in the graph
    whatever the depth: the slabs are small (NORM_SLAB_ELEMENTS; one plane per slab at 512^2 x 32),
    and unrolled, as ``slabs.write_slabs`` runs the conv's few large slabs, each of the norm's four
    passes would put 512 copies of its body per sample in the graph at 512^3.
    """
    depth = norm.depth
    for first, count, n in _slab_ranges(depth, norm.planes):
        def step(i, *state, first=first, n=n):
            row = sample * depth + first + i * n
            return (i + 1, *body(row, _rows_at(rows, row, n), tuple(state)))

        state = tuple(tf.while_loop(lambda i, *_, count=count: i < count, step, (tf.constant(0), *state),
                                    parallel_iterations=1)[1:])
    return state


def _channel_vector(t, norm: _SlabNorm):
    """(1, 1, G, 1 or Cg) -> (C,): a per-group or per-channel statistic as the fused kernels take it."""
    return tf.reshape(tf.broadcast_to(t, (1, 1, norm.groups, norm.per_group)), (norm.shape[4],))


def _as_4d(t):
    """(..., H, W, C) -> (1, -1, H*W, C): the 4-D view oneDNN's batch norm takes (see instance_norm_activation)."""
    height, width, channels = t.shape[-3:]
    return tf.reshape(t, (1, -1, height * width, channels))


def _affine(t, scale, offset, mean, variance, epsilon: float):
    """scale * (t - mean) / sqrt(variance + epsilon) + offset per channel, in t's shape and dtype.

    FusedBatchNormV3 in inference mode on the 4-D view: oneDNN, float32 inside the kernel.
    """
    return tf.reshape(tf.raw_ops.FusedBatchNormV3(
        x=_as_4d(t), scale=scale, offset=offset, mean=mean, variance=variance, epsilon=epsilon,
        data_format="NHWC", is_training=False)[0], t.shape)


def _chan_update(_, slab, state, *, norm: _SlabNorm):
    """One slab folded into the running (count, mean, sum of squared deviations) per group (Chan et al.)."""
    n, mean, m2 = state
    xs = tf.cast(slab, tf.float32)
    n_slab = tf.cast(tf.size(xs) // norm.groups, tf.float32)
    mean_slab = _group_sums(xs, norm.groups) / n_slab
    m2_slab = _group_sums(tf.math.squared_difference(xs, _per_channel(mean_slab, norm.per_group)), norm.groups)
    delta, total = mean_slab - mean, n + n_slab
    return total, mean + delta * (n_slab / total), m2 + m2_slab + delta * delta * (n * n_slab / total)


def _sample_statistics(x_planes, norm: _SlabNorm) -> list[_Moments]:
    """Each sample's mean and biased variance per group, from small slabs in float32 (pairwise updates)."""
    moments = []
    for sample in range(norm.shape[0]):
        zeros = tf.zeros((1, 1, norm.groups, 1))
        _, mean, m2 = _over_slabs(x_planes, norm, sample, functools.partial(_chan_update, norm=norm),
                                  (tf.constant(0.0), zeros, zeros))
        variance = m2 / norm.count
        moments.append(_Moments(mean, variance, _channel_vector(mean, norm), _channel_vector(variance, norm)))
    return moments


def _activation_grad(dy, y, activation: str, negative_slope: float):
    """dz from dy and the activation's output (its sign is the pre-activation's)."""
    if activation == "relu":
        return tf.raw_ops.ReluGrad(gradients=dy, features=y)
    if activation == "leaky_relu":
        return tf.raw_ops.LeakyReluGrad(gradients=dy, features=y, alpha=negative_slope)
    return dy


def _dx_coefficients(sum_dz, sum_dz_xc, rstd, gamma, norm: _SlabNorm):
    """dgamma, dbeta and dx's per-channel (C,) coefficients ``(k1, k2 * sqrt(var + eps), k3)``.

    dx = k1 dz + k2 (x - mean) + k3 (``_input_grad_coefficients``) is made as two inference-mode
    norms (``_input_gradient``): k1 dz as a norm of dz with mean 0 and variance 1 - epsilon,
    k2 (x - mean) + k3 as one of x with scale k2 sqrt(var + eps).

    Args:
        sum_dz, sum_dz_xc: one sample's sums of dz and dz * (x - mean), (1, 1, G, Cg) float32.
        rstd: 1 / sqrt(variance + epsilon) per group, (1, 1, G, 1).
        gamma: (C,) float32.
        norm: the op.
    """
    g = tf.reshape(gamma, (1, 1, norm.groups, norm.per_group))
    dgamma, dbeta, (k1, k2, k3) = _input_grad_coefficients(g, 0.0, rstd, sum_dz, sum_dz_xc, norm.count)
    return dgamma, dbeta, (_channel_vector(k1, norm), _channel_vector(k2 / rstd, norm), _channel_vector(k3, norm))


def _input_gradient(dz, x, coefficients, moments: _Moments, epsilon: float):
    """dx = k1 dz + k2 (x - mean) + k3 as two inference-mode norms and an add (``_dx_coefficients``)."""
    scale_dz, scale_x, offset_x = coefficients
    channels = dz.shape[-1]
    zero = tf.zeros((channels,))
    ones = tf.ones((channels,)) - epsilon  # a variance that makes the norm's divisor 1
    return (_affine(dz, scale_dz, zero, zero, ones, epsilon)
            + _affine(x, scale_x, offset_x, moments.mean, moments.variance, epsilon))


def _write_rows(rows, row, values):
    """``rows`` with ``values`` (1, n, H, W, C) written in place from ``row`` on, in the rows' dtype."""
    n = values.shape[1]
    return tf.raw_ops.InplaceUpdate(x=rows, i=tf.range(row, row + n),
                                    v=tf.cast(tf.reshape(values, (n, *rows.shape[1:])), rows.dtype))


# ---- the slab norm's passes (norm_activation_slabs) --------------------------------------------


def _normalise_slab(row, slab, state, *, gamma, beta, moments: _Moments, norm: _SlabNorm):
    """The forward of one slab: the norm with the sample's statistics, the activation, written to ``state``'s rows."""
    z = _affine(slab, gamma, beta, moments.mean, moments.variance, norm.epsilon)
    return (_write_rows(state[0], row, _activate(z, norm.activation, norm.negative_slope)),)


def _dz_slab(dy_planes, row, slab, *, gamma, beta, moments: _Moments, norm: _SlabNorm):
    """The gradient at one slab's pre-activation, (1, n, H, W, C), in dy's dtype.

    The pre-activation is made again from the slab rather than read from the output: keeping y
    for backward would add a tensor of x's size to the op (block_bf16 of bench_slabs --proof then
    ran out of 24 GiB).
    """
    dy_slab = _rows_at(dy_planes, row, slab.shape[1])
    if norm.activation == "linear":
        return dy_slab
    z = tf.cast(_affine(slab, gamma, beta, moments.mean, moments.variance, norm.epsilon), dy_slab.dtype)
    return _activation_grad(dy_slab, z, norm.activation, norm.negative_slope)


def _gradient_sums_slab(row, slab, state, *, dz_of, gamma, moments: _Moments, norm: _SlabNorm):
    """One slab's sums of dz and dz * (x - mean) / sqrt(variance + epsilon) per channel, added to ``state``.

    FusedBatchNormGradV3 in inference mode: its offset_backprop is the first, its scale_backprop
    the second, (C,) float32 each.
    """
    grads = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=_as_4d(dz_of(row, slab)), x=_as_4d(slab), scale=gamma, reserve_space_1=moments.mean,
        reserve_space_2=moments.variance, reserve_space_3=tf.constant([], tf.float32), epsilon=norm.epsilon,
        data_format="NHWC", is_training=False)
    return state[0] + grads[2], state[1] + grads[1]


def _input_gradient_slab(row, slab, state, *, dz_of, coefficients, moments: _Moments, norm: _SlabNorm):
    """One slab's dx, written to ``state``'s rows.

    In bfloat16 the two terms are made and added in float32: rounded to bfloat16 first, they
    cancel where the mean is large against the spread (a conv -> norm block's input gradient came
    out 12% off).
    """
    dz, xs = dz_of(row, slab), slab
    if slab.dtype != tf.float32:
        dz, xs = tf.cast(dz, tf.float32), tf.cast(xs, tf.float32)
    return (_write_rows(state[0], row, _input_gradient(dz, xs, coefficients, moments, norm.epsilon)),)


def _normalise_slabs(x_planes, gamma, beta, moments: list[_Moments], norm: _SlabNorm):
    """The slab norm's forward: (B*D, H, W, C) rows, each slab written in place."""
    y_rows = tf.raw_ops.Empty(shape=x_planes.shape, dtype=x_planes.dtype, init=False)
    for sample, sample_moments in enumerate(moments):
        (y_rows,) = _over_slabs(x_planes, norm, sample, functools.partial(
            _normalise_slab, gamma=gamma, beta=beta, moments=sample_moments, norm=norm), (y_rows,))
    return y_rows


def _slab_gradients(x_planes, dy_planes, gamma, beta, moments: list[_Moments], norm: _SlabNorm):
    """The slab norm's backward: dx as (B*D, H, W, C) rows, dgamma and dbeta (C,).

    Per sample, a first pass sums dz and dz * (x - mean) per channel, a second writes dx.
    """
    channels = norm.shape[4]
    zero = tf.zeros((channels,))
    grouped = (1, 1, norm.groups, norm.per_group)
    dgammas, dbetas = [], []
    dx_rows = tf.raw_ops.Empty(shape=x_planes.shape, dtype=x_planes.dtype, init=False)
    for sample, sample_moments in enumerate(moments):
        common = dict(moments=sample_moments, norm=norm)
        dz_of = functools.partial(_dz_slab, dy_planes, gamma=gamma, beta=beta, **common)
        sum_dz, sum_dz_xhat = _over_slabs(x_planes, norm, sample, functools.partial(
            _gradient_sums_slab, dz_of=dz_of, gamma=gamma, **common), (zero, zero))
        rstd = tf.math.rsqrt(sample_moments.group_variance + norm.epsilon)
        dgamma, dbeta, coefficients = _dx_coefficients(
            tf.reshape(sum_dz, grouped), tf.reshape(sum_dz_xhat, grouped) / rstd, rstd, gamma, norm)
        (dx_rows,) = _over_slabs(x_planes, norm, sample, functools.partial(
            _input_gradient_slab, dz_of=dz_of, coefficients=coefficients, **common), (dx_rows,))
        dgammas.append(dgamma)
        dbetas.append(dbeta)
    return dx_rows, tf.add_n(dgammas), tf.add_n(dbetas)


@counted('norm_activation')
def norm_activation_slabs(x, gamma, beta, *, groups: int, epsilon: float, activation: str,
                          negative_slope: float):
    """``fused_norm_activation`` over depth slabs, for tensors past the kernel limit (nets/slabs.py).

    ``norm_activation_large`` slab by slab: the statistics are combined from per-slab means and
    sums of squared deviations (Chan, Golub and LeVeque's pairwise update, float32); then each
    slab goes through TF's fused kernels and is written in place: FusedBatchNormV3 in inference
    mode with those statistics (oneDNN, float32 inside the kernel) and the activation. Backward:
    a first pass sums dz and dz * (x - mean) per channel with FusedBatchNormGradV3 in inference
    mode (one kernel per slab; dz = the activation's gradient at the slab's pre-activation, made
    again from x, so only x is kept), a second
    writes dx = k1 dz + k2 (x - mean) + k3 as two inference-mode norms and an add. Every
    temporary is one slab and the slabs run as tf.while_loops (NORM_SLAB_ELEMENTS). Fused kernels
    in place of chains of elementwise ops: the slab loop of one op each read and wrote the slab
    about 20 times forward and backward (benchmarks/results/kernels.md has both speeds).

    Args:
        x: (batch, D, H, W, C), static shape, any float dtype.
        gamma, beta: (C,) float32.
        groups: channel groups (C for instance norm).
        epsilon, activation, negative_slope: as ``fused_norm_activation``.

    Returns:
        (batch, D, H, W, C) in x's dtype, equal to ``fused_norm_activation`` (to float rounding).

    Raises:
        SlabTooLargeError: one depth plane of ``x`` is already past the kernel limit.
    """
    norm = _slab_norm(x, groups, epsilon, activation, negative_slope)

    @tf.custom_gradient
    def forward(x, gamma, beta):
        x_planes = as_planes(x)
        moments = _sample_statistics(x_planes, norm)
        y_rows = _normalise_slabs(x_planes, gamma, beta, moments, norm)

        def backward(dy):
            dx_rows, dgamma, dbeta = _slab_gradients(x_planes, as_planes(dy), gamma, beta, moments, norm)
            return tf.reshape(dx_rows, x.shape), dgamma, dbeta

        return tf.reshape(y_rows, x.shape), backward

    return forward(x, gamma, beta)


# ---- the large-volume norm (norm_activation_large) ---------------------------------------------


def _centred_sums_slab(row, slab, state, *, dz_planes, moments: _Moments, norm: _SlabNorm):
    """One slab's sums of dz and dz * (x - mean) per (sample, channel), (1, 1, G, Cg) float32, added to ``state``."""
    grouped = (1, -1, norm.groups, norm.per_group)
    xc = tf.reshape(tf.cast(slab, tf.float32), grouped) - moments.group_mean
    dz = tf.reshape(tf.cast(_rows_at(dz_planes, row, slab.shape[1]), tf.float32), grouped)
    return (state[0] + _channel_sums(tf.reshape(dz, slab.shape), None, norm.groups),
            state[1] + _channel_sums(tf.reshape(dz * xc, slab.shape), None, norm.groups))


def _large_gradients(x, x_planes, dz, gamma, moments: list[_Moments], norm: _SlabNorm):
    """The large norm's backward from dz (the activation's gradient): dx (B, D, H, W, C), dgamma and dbeta (C,)."""
    dz_planes = as_planes(dz)
    dgammas, dbetas, dxs = [], [], []
    for sample, sample_moments in enumerate(moments):
        zeros = tf.zeros((1, 1, norm.groups, norm.per_group))
        sum_dz, sum_dz_xc = _over_slabs(x_planes, norm, sample, functools.partial(
            _centred_sums_slab, dz_planes=dz_planes, moments=sample_moments, norm=norm), (zeros, zeros))
        rstd = tf.math.rsqrt(sample_moments.group_variance + norm.epsilon)
        dgamma, dbeta, coefficients = _dx_coefficients(sum_dz, sum_dz_xc, rstd, gamma, norm)
        dxs.append(_input_gradient(dz[sample:sample + 1], x[sample:sample + 1], coefficients, sample_moments,
                                   norm.epsilon))
        dgammas.append(dgamma)
        dbetas.append(dbeta)
    return (dxs[0] if len(dxs) == 1 else tf.concat(dxs, axis=0)), tf.add_n(dgammas), tf.add_n(dbetas)


def norm_activation_large(x, gamma, beta, *, groups: int, epsilon: float, activation: str,
                          negative_slope: float):
    """Group norm + activation for samples past FUSED_NORM_MAX_VOXELS whose tensors are under the kernel limit.

    The sums (statistics; dz and dz * (x - mean) for the gradient) run over small depth slabs in
    float32 (``_over_slabs``), where FusedBatchNormV3's own sums drift; every full-size
    elementwise step is one of TF's fused kernels instead of a slab loop: FusedBatchNormV3 in
    inference mode with those statistics (oneDNN on the 4-D view), the activation and its
    gradient (ReluGrad), and dx = k1 dz + k2 (x - mean) + k3 as two inference-mode norms and an
    add. Those kernels may reuse their input's buffer, as the fused training-mode norm's gradient
    does; the slab loop's written-in-place outputs cannot, and held one more full-size tensor
    per norm layer (enough to put kits19 at 288^3 out of memory; benchmarks/results/kernels.md).

    Args:
        x: ``(batch, D, H, W, C)``, static shape, under the kernel limit; any float dtype.
        gamma, beta: ``(C,)`` float32.
        groups, epsilon, activation, negative_slope: as ``fused_norm_activation``.

    Returns:
        ``(batch, D, H, W, C)`` in x's dtype, equal to ``fused_norm_activation`` (to float rounding).
    """
    norm = _slab_norm(x, groups, epsilon, activation, negative_slope)

    @tf.custom_gradient
    def forward(x, gamma, beta):
        x_planes = as_planes(x)
        moments = _sample_statistics(x_planes, norm)
        outputs = [_affine(x[i:i + 1], gamma, beta, m.mean, m.variance, epsilon) for i, m in enumerate(moments)]
        y = _activate(outputs[0] if len(outputs) == 1 else tf.concat(outputs, axis=0), activation, negative_slope)

        def backward(dy):
            return _large_gradients(x, x_planes, _activation_grad(dy, y, activation, negative_slope), gamma,
                                    moments, norm)

        return y, backward

    return forward(x, gamma, beta)


def _fused_batch_norm_float32(x, gamma, beta, epsilon: float):
    """FusedBatchNormV3 (training mode, NHWC) of a bfloat16 x computed in float32, keeping only x.

    The float32 copy of x is made again for the gradient instead of being kept, so the norm
    holds no more memory than the bfloat16 kernel would.
    """
    empty = tf.constant([], tf.float32)

    @tf.custom_gradient
    def norm(x, gamma, beta):
        y, _, _, mean, inverse, workspace = tf.raw_ops.FusedBatchNormV3(
            x=tf.cast(x, tf.float32), scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=epsilon,
            data_format="NHWC", is_training=True)

        def grad(dy):
            dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=tf.cast(dy, tf.float32), x=tf.cast(x, tf.float32), scale=gamma, reserve_space_1=mean,
                reserve_space_2=inverse, reserve_space_3=workspace, epsilon=epsilon, data_format="NHWC",
                is_training=True)
            return tf.cast(dx, x.dtype), dgamma, dbeta

        return tf.cast(y, x.dtype), grad

    return norm(x, gamma, beta)


def instance_norm_activation(x, gamma, beta, *, epsilon: float, activation: str, negative_slope: float):
    """act(instance_norm(x)) as one FusedBatchNormV3 per sample; needs a static batch size.

    The kernel normalises with the biased variance in training mode, as instance norm does;
    its variance output (Bessel-corrected, for moving averages) is not used. Meant for samples
    of at most FUSED_NORM_MAX_VOXELS voxels, whose statistics the kernel gets right.

    Args:
        x: ``(batch, D, H, W, C)`` with a static batch size and C; any float dtype.
        gamma, beta: ``(C,)`` float32.
        epsilon, activation, negative_slope: as ``fused_norm_activation``.

    Returns:
        ``(batch, D, H, W, C)`` in x's dtype.
    """
    samples = tf.split(x, x.shape[0]) if x.shape[0] > 1 else [x]
    shape = tf.shape(x)
    channels = x.shape[-1]
    # (1, D, H*W, C) in NHWC: the same per-channel statistics over space, and a 4-D
    # FusedBatchNormV3, which TF's oneDNN graph pass rewrites to oneDNN's batch normalisation
    # (it leaves the 5-D form on the generic Eigen kernel, which is slower).
    # oneDNN's vectorised kernel needs whole vectors of channels; otherwise it falls back to a
    # reference kernel slower than Eigen's, so such channel counts stay 5-D. The activation
    # follows the norm directly, so TF's remapper can fuse a ReLU into it. Timings of each
    # choice: benchmarks/results/kernels.md.
    onednn = channels % ONEDNN_NORM_CHANNEL_MULTIPLE.get(x.dtype.name, 16) == 0
    # bfloat16 with a channel count only oneDNN's float32 kernel vectorises (8): that kernel,
    # between casts, beats the 5-D one (benchmarks/results/kernels.md).
    via_float32 = (not onednn and x.dtype == tf.bfloat16
                   and channels % ONEDNN_NORM_CHANNEL_MULTIPLE["float32"] == 0)
    as_4d = tf.stack([1, shape[1], -1, channels])
    outputs = []
    for sample in samples:
        if via_float32:
            y = _fused_batch_norm_float32(tf.reshape(sample, as_4d), gamma, beta, epsilon)
        elif onednn:
            y = tf.compat.v1.nn.fused_batch_norm(tf.reshape(sample, as_4d), gamma, beta, epsilon=epsilon,
                                                 is_training=True, data_format="NHWC")[0]
        else:
            y = tf.compat.v1.nn.fused_batch_norm(sample, gamma, beta, epsilon=epsilon, is_training=True,
                                                 data_format="NDHWC")[0]
        if activation == "relu":
            y = tf.nn.relu(y)
        elif activation == "leaky_relu":
            y = tf.nn.leaky_relu(y, alpha=negative_slope)
        outputs.append(y)
    y = outputs[0] if len(outputs) == 1 else tf.concat(outputs, axis=0)
    return tf.reshape(y, shape)


@keras.saving.register_keras_serializable(package="bigmem")
class NormActivation(keras.layers.Layer):
    """Group normalisation (``groups=-1``: instance normalisation) fused with an activation.

    Normalises each sample over space and each group of channels, then scales by ``gamma`` and
    shifts by ``beta`` (one each per channel, float32 variables), then applies the activation.
    Statistics are float32; the output has the layer's compute dtype. The kernel is chosen by
    size: one fused batch norm per sample (instance norm), a custom gradient (group norm),
    small-slab statistics past FUSED_NORM_MAX_VOXELS voxels per sample, depth slabs past the
    kernel element limit (nets/slabs.py).

    Args:
        groups: channel groups; -1 (default) for one per channel (instance norm). The channel
            count must be divisible by it.
        epsilon: added to the variance (default 1e-5).
        activation: ``"relu"`` (default), ``"leaky_relu"`` or ``"linear"``.
        negative_slope: the leaky ReLU's slope for negative inputs (default 0.01).
        zero_init: start ``gamma`` at 0 instead of 1 (the last norm of a residual branch).
        **kwargs: passed to ``keras.layers.Layer`` (``name``, ``dtype``).

    Raises:
        ValueError: ``activation`` is not one of ``ACTIVATIONS``; on build, the channel count is
            not divisible by ``groups``.

    Example:
        >>> norm = NormActivation(groups=-1, activation="leaky_relu")
        >>> norm(keras.ops.ones((2, 16, 16, 16, 8))).shape  # (2, 16, 16, 16, 8)
    """

    def __init__(self, groups: int = -1, epsilon: float = 1e-5, activation: str = "relu",
                 negative_slope: float = 0.01, zero_init: bool = False, **kwargs):
        super().__init__(**kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        self.groups = int(groups)
        self.epsilon = float(epsilon)
        self.activation = activation
        self.negative_slope = float(negative_slope)
        self.zero_init = bool(zero_init)

    def build(self, input_shape):
        """Create ``gamma`` and ``beta``, ``(C,)`` each, for ``input_shape`` ``(batch, D, H, W, C)``."""
        channels = int(input_shape[-1])
        groups = channels if self.groups == -1 else self.groups
        if channels % groups:
            raise ValueError(f"{channels} channels cannot be split into {groups} groups")
        self._num_groups = groups
        # Not autocast: under mixed_bfloat16 Keras would hand call() gamma and beta rounded to
        # bfloat16 (0.7 -> 0.6992, -0.2 -> -0.2002), as its own BatchNormalization avoids too.
        self.gamma = self.add_weight(shape=(channels,), name="gamma", dtype=self.variable_dtype, autocast=False,
                                     initializer="zeros" if self.zero_init else "ones")
        self.beta = self.add_weight(shape=(channels,), name="beta", dtype=self.variable_dtype, autocast=False,
                                    initializer="zeros")

    def call(self, x):
        """``(batch, D, H, W, C)`` -> normalised and activated, same shape, the compute dtype."""
        gamma = tf.cast(tf.convert_to_tensor(self.gamma), tf.float32)
        beta = tf.cast(tf.convert_to_tensor(self.beta), tf.float32)
        x = tf.cast(x, self.compute_dtype)
        voxels = None if None in x.shape[1:4] else x.shape[1] * x.shape[2] * x.shape[3]
        if exceeds_limit(x.shape):
            return norm_activation_slabs(x, gamma, beta, groups=self._num_groups, epsilon=self.epsilon,
                                         activation=self.activation, negative_slope=self.negative_slope)
        if voxels is not None and voxels > FUSED_NORM_MAX_VOXELS and None not in x.shape:
            return norm_activation_large(x, gamma, beta, groups=self._num_groups, epsilon=self.epsilon,
                                         activation=self.activation, negative_slope=self.negative_slope)
        if self._num_groups == x.shape[-1] and x.shape[0] is not None and x.shape.rank == 5:
            return instance_norm_activation(x, gamma, beta, epsilon=self.epsilon, activation=self.activation,
                                            negative_slope=self.negative_slope)
        return fused_norm_activation(x, gamma, beta, groups=self._num_groups, epsilon=self.epsilon,
                                     activation=self.activation, negative_slope=self.negative_slope)

    def compute_output_shape(self, input_shape):
        """The input's shape."""
        return input_shape

    def get_config(self):
        """The constructor's arguments, for ``from_config`` and saving."""
        return {**super().get_config(), "groups": self.groups, "epsilon": self.epsilon,
                "activation": self.activation, "negative_slope": self.negative_slope, "zero_init": self.zero_init}
