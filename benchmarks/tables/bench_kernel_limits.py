"""Which TensorFlow CPU kernels of a 3D U-Net training step survive tensors past 2^31 elements.

    python benchmarks/tables/bench_kernel_limits.py [--ops conv3d,relu,...] [--sizes auto|below|above|below,above]
        [--onednn auto|1|0|1,0] [--quick] [--timeout-s 1200] [--out DIR]

Each (op, size, oneDNN setting) runs in a fresh child process (a crash kills only the child),
under an exclusive lock on /tmp/bigmem-heavy.lock so it never shares the machine's memory with
another multi-GB measurement. Sizes: (1, D, 1024, 1024, 2) with D = 1020 (2.139e9 elements,
below 2^31) and D = 1032 (2.164e9, above); the element at flat index 2^31 sits in plane 1024.
``--sizes auto`` runs "above" first and "below" only when "above" did not give a correct result.

Data are a random block of PERIOD planes tiled along depth (tile allocates only its output).
PERIOD does not divide 1024, so a kernel whose indices wrap at 2^31 reads different values and
shows up as an error. Every op's output is compared, slab by slab over its whole depth, against
an independent reference computed on that slab alone (the same op on the slab plus its halo, or
float64 NumPy); reductions (weight gradients, sums, statistics) against the float64 sum of the
slabs' references. The reference of a slab depends only on its input planes, so interior slabs
with the same phase in the tiling share one reference computation.

Memory: an fp32 tensor above 2^31 elements is 8.6 GB, so ops holding three such tensors (add,
ReluGrad, SoftmaxCrossEntropyWithLogits, FusedBatchNormGradV3) run in bfloat16 on this 24 GiB
machine, and conv3d also runs in bfloat16 to tell an element limit from a byte limit. A timing
here is one cold run (a limit probe, not a throughput benchmark). Prints a table and writes
JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import ChildRun, bench_parser, command_line, heavy_turn, run_function, write_results

INT32_LIMIT = 2**31
# Depths of (1, D, 1024, 1024, 2): the largest multiple of 6 below 2^31 elements and the issue's
# size above it (multiples of 6: stride-2 ops halve the depth, which must stay a multiple of PERIOD).
FULL = {"hw": 1024, "channels": 2, "depths": {"below": 1020, "above": 1032}}
SMALL = {"hw": 32, "channels": 2, "depths": {"below": 24, "above": 30}}
PERIOD = 3  # planes in the tiled random block; 1024 % 3 != 0 (see the module docstring)
SLAB = 8  # planes per compared slab (a float64 slab of (8, 1024, 1024, 2) is 134 MB)
EDGE = 6  # slabs closer than this to either end get their own reference (padding, halo clipping)
# max |error| / max |reference| above which a result counts as wrong: a few units in the last
# place of a sum of ~10^9 terms (fp32), or of one bfloat16 rounding (8 bits of mantissa).
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "int64": 0.0}


@dataclass
class Check:
    """One output of the op: compared slab by slab ("slab") or as a sum of slab terms ("sum")."""

    name: str
    index: int
    kind: str
    reference: Callable  # (a, b) -> array: the output's planes [a, b), or the slab's share of the sum


@dataclass
class Case:
    """The op on its big inputs, and how to check each of its outputs."""

    inputs: list
    fn: Callable
    depth: int  # planes of the compared outputs, along which slabs are taken
    checks: list[Check] = field(default_factory=list)


@dataclass(frozen=True)
class OpSpec:
    build: Callable  # (depth, hw, channels) -> Case
    dtype: str
    onednn: tuple[str, ...]  # TF_ENABLE_ONEDNN_OPTS values run by --onednn auto
    note: str


# ---------------------------------------------------------------- data and references (child side)


def tiled(shape, dtype="float32", seed=0, low=-1.0, high=2.0, base=None):
    """A (N, D, ...) tensor: a random (N, PERIOD, ...) block tiled along axis 1, cast before tiling."""
    import tensorflow as tf

    block_shape = [shape[0], PERIOD, *shape[2:]]
    block = base if base is not None else tf.random.stateless_uniform(block_shape, [seed, 7], low, high)
    reps = [1, shape[1] // PERIOD] + [1] * (len(shape) - 2)
    return tf.tile(tf.cast(block, dtype), reps)


def f64(t):
    import numpy as np

    return np.asarray(t.numpy() if hasattr(t, "numpy") else t).astype(np.float64)


def with_halo(t, a, b, halo, depth, axis=1):
    """Planes [a - halo, b + halo) of t along axis, clipped to [0, depth); and where [a, b) starts in it."""
    import tensorflow as tf

    lo, hi = max(a - halo, 0), min(b + halo, depth)
    begin = [0] * len(t.shape)
    size = [-1] * len(t.shape)
    begin[axis], size[axis] = lo, hi - lo
    return tf.slice(t, begin, size), a - lo


def planes(t, a, b, axis=1):
    return with_halo(t, a, b, 0, t.shape[axis], axis)[0]


def conv3d_case(depth, hw, channels, *, ksize=3, stride=1, precision="float32"):
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], precision, seed=1)
    k = tf.cast(tf.random.stateless_normal([ksize] * 3 + [channels, channels], [2, 7]) / ksize**1.5, precision)
    strides = [1, stride, stride, stride, 1]

    def fn(x):
        return (tf.nn.conv3d(x, k, strides, "SAME"),)

    def conv32(piece):  # the reference runs in float32 whatever the precision of the big op
        return f64(tf.nn.conv3d(tf.cast(piece, "float32"), tf.cast(k, "float32"), strides, "SAME"))

    def reference(a, b):  # output planes [a, b)
        if stride == 1:
            piece, start = with_halo(x, a, b, ksize // 2, depth)
            return conv32(piece)[:, start:start + b - a]
        # SAME, stride 2, even depth: output plane j reads input planes 2j .. 2j + 2 (plane D is padding)
        return conv32(planes(x, 2 * a, min(2 * b + 2, depth)))[:, :b - a]

    return Case([x], fn, depth // stride, [Check("y", 0, "slab", reference)])


def conv3d_backprop_input_case(depth, hw, channels):
    import tensorflow as tf

    dy = tiled([1, depth, hw, hw, channels], seed=3)
    k = tf.random.stateless_normal([3, 3, 3, channels, channels], [2, 7]) / 5.2

    def op(dy):
        return tf.raw_ops.Conv3DBackpropInputV2(input_sizes=tf.shape(dy), filter=k, out_backprop=dy,
                                                strides=[1] * 5, padding="SAME")

    def reference(a, b):
        piece, start = with_halo(dy, a, b, 1, depth)
        return f64(op(piece))[:, start:start + b - a]

    return Case([dy], lambda dy: (op(dy),), depth, [Check("dx", 0, "slab", reference)])


def conv3d_backprop_filter_case(depth, hw, channels):
    import numpy as np
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], seed=1)
    dy = tiled([1, depth, hw, hw, channels], seed=3)
    sizes = [3, 3, 3, channels, channels]

    def op(x, dy):
        return tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=sizes, out_backprop=dy,
                                                 strides=[1] * 5, padding="SAME")

    def reference(a, b):  # the share of output planes [a, b): dy zero on the halo planes
        xs, start = with_halo(x, a, b, 1, depth)
        dys = with_halo(dy, a, b, 1, depth)[0]
        mask = np.zeros([1, xs.shape[1], 1, 1, 1], np.float32)
        mask[:, start:start + b - a] = 1
        return f64(op(xs, dys * mask))

    return Case([x, dy], lambda x, dy: (op(x, dy),), depth, [Check("dfilter", 0, "sum", reference)])


def conv3d_transpose_case(depth, hw, channels):
    import tensorflow as tf

    z = tiled([1, depth // 2, hw // 2, hw // 2, channels], seed=1)  # output (1, depth, hw, hw, channels)
    k = tf.random.stateless_normal([2, 2, 2, channels, channels], [2, 7]) / 2.8

    def op(z):
        shape = [1, 2 * z.shape[1], hw, hw, channels]
        return tf.nn.conv3d_transpose(z, k, shape, [1, 2, 2, 2, 1], "SAME")

    return Case([z], lambda z: (op(z),), depth,
                [Check("y", 0, "slab", lambda a, b: f64(op(planes(z, a // 2, b // 2))))])


def conv2d_planes_case(depth, hw, channels):
    import tensorflow as tf

    x = tf.reshape(tiled([1, depth, hw, hw, channels], seed=1), [depth, hw, hw, channels])
    k = tf.random.stateless_normal([3, 3, channels, channels], [2, 7]) / 4.2

    def op(x):
        return tf.nn.conv2d(x, k, 1, "SAME")

    return Case([x], lambda x: (op(x),), depth, [Check("y", 0, "slab", lambda a, b: f64(op(planes(x, a, b, 0))))])


def conv2d_backprop_filter_planes_case(depth, hw, channels):
    import tensorflow as tf

    x = tf.reshape(tiled([1, depth, hw, hw, channels], seed=1), [depth, hw, hw, channels])
    dy = tf.reshape(tiled([1, depth, hw, hw, channels], seed=3), [depth, hw, hw, channels])

    def op(x, dy):
        return tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[3, 3, channels, channels], out_backprop=dy,
                                               strides=[1, 1, 1, 1], padding="SAME")

    return Case([x, dy], lambda x, dy: (op(x, dy),), depth,
                [Check("dfilter", 0, "sum", lambda a, b: f64(op(planes(x, a, b, 0), planes(dy, a, b, 0))))])


def _moments64(x, depth, channels, axis=1):
    """Per-channel float64 mean and (biased) variance of x, summed over slabs of planes."""
    import numpy as np

    total, squares = np.zeros(channels), np.zeros(channels)
    for a in range(0, depth, SLAB):
        piece = f64(planes(x, a, min(a + SLAB, depth), axis)).reshape(-1, channels)
        total += piece.sum(0)
        squares += (piece * piece).sum(0)
    count = x.shape.num_elements() // channels
    mean = total / count
    return mean, squares / count - mean * mean


def fused_bn_case(depth, hw, channels, *, five_d=False):
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], seed=1)
    x = x if five_d else tf.reshape(x, [1, depth, hw * hw, channels])
    scale, offset, epsilon = tf.constant([1.5] * channels), tf.constant([0.25] * channels), 1e-3

    def fn(x):
        return tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=tf.constant([], tf.float32),
                                           variance=tf.constant([], tf.float32), epsilon=epsilon, is_training=True,
                                           data_format="NDHWC" if five_d else "NHWC")[:3]

    stats = {}

    def normalized(a, b):
        if not stats:
            stats["mean"], stats["var"] = _moments64(x, depth, channels)
        return (f64(planes(x, a, b)) - stats["mean"]) / (stats["var"] + epsilon) ** 0.5 * 1.5 + 0.25

    def mean_share(a, b):
        return f64(planes(x, a, b)).reshape(-1, channels).sum(0) / (x.shape.num_elements() // channels)

    return Case([x], fn, depth, [Check("y", 0, "slab", normalized), Check("mean", 1, "sum", mean_share)])


def fused_bn_grad_case(depth, hw, channels, dtype="bfloat16"):
    import tensorflow as tf

    x_block = tf.random.stateless_uniform([1, PERIOD, hw * hw, channels], [1, 7], -1.0, 2.0)
    x = tiled([1, depth, hw * hw, channels], dtype, base=x_block)
    # dy correlated with x, so that dscale = sum(dy * xhat) does not cancel to a tiny number
    dy_block = 0.5 * x_block + tf.random.stateless_uniform(x_block.shape, [3, 7], -1.0, 1.0)
    dy = tiled([1, depth, hw * hw, channels], dtype, base=dy_block)
    epsilon, gamma = 1e-3, 1.5
    mean, var = _moments64(x, depth, channels)
    count = x.shape.num_elements() // channels

    def fn(dy, x):
        return tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=dy, x=x, scale=tf.constant([gamma] * channels), reserve_space_1=tf.constant(mean, tf.float32),
            reserve_space_2=tf.constant(var, tf.float32), reserve_space_3=tf.constant([], tf.float32),
            epsilon=epsilon, data_format="NHWC", is_training=True)[:3]

    sigma = (var + epsilon) ** 0.5

    def pieces(a, b):
        return f64(planes(dy, a, b)), (f64(planes(x, a, b)) - mean) / sigma

    def dscale_share(a, b):
        dys, xhat = pieces(a, b)
        return (dys * xhat).reshape(-1, channels).sum(0)

    def doffset_share(a, b):
        return pieces(a, b)[0].reshape(-1, channels).sum(0)

    sums = {}

    def dx(a, b):
        if not sums:
            sums["dscale"] = sum(dscale_share(s, min(s + SLAB, depth)) for s in range(0, depth, SLAB))
            sums["doffset"] = sum(doffset_share(s, min(s + SLAB, depth)) for s in range(0, depth, SLAB))
        dys, xhat = pieces(a, b)
        return gamma / sigma * (dys - sums["doffset"] / count - xhat * sums["dscale"] / count)

    return Case([dy, x], fn, depth, [Check("dx", 0, "slab", dx), Check("dscale", 1, "sum", dscale_share),
                                     Check("doffset", 2, "sum", doffset_share)])


def _pool_windows(t):
    """(1, 2n, 2h, 2w, C) -> (n, 2, h, 2, w, 2, C) float64: the 2x2x2 windows of max_pool3d."""
    _, d, h, w, c = t.shape
    return f64(t).reshape(d // 2, 2, h // 2, 2, w // 2, 2, c)


def max_pool3d_case(depth, hw, channels):
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], seed=1)

    def reference(a, b):
        return _pool_windows(planes(x, 2 * a, 2 * b)).max(axis=(1, 3, 5))[None]

    return Case([x], lambda x: (tf.nn.max_pool3d(x, 2, 2, "VALID"),), depth // 2,
                [Check("y", 0, "slab", reference)])


def max_pool3d_grad_case(depth, hw, channels):
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], seed=1)
    # the pooled output slab by slab, so that this check does not depend on the forward kernel's limit
    y = tf.concat([tf.nn.max_pool3d(planes(x, a, min(a + SLAB, depth)), 2, 2, "VALID")
                   for a in range(0, depth, SLAB)], axis=1)
    dy = tiled(y.shape, seed=3)

    def fn(x, y, dy):
        return (tf.raw_ops.MaxPool3DGrad(orig_input=x, orig_output=y, grad=dy, ksize=[1, 2, 2, 2, 1],
                                         strides=[1, 2, 2, 2, 1], padding="VALID"),)

    def reference(a, b):  # input planes [a, b), a and b even; no ties in random data
        windows = _pool_windows(planes(x, a, b))
        winner = windows == windows.max(axis=(1, 3, 5), keepdims=True)
        grads = f64(planes(dy, a // 2, b // 2))[0][:, None, :, None, :, None, :]
        return (winner * grads).reshape(1, b - a, hw, hw, channels)

    return Case([x, y, dy], fn, depth, [Check("dx", 0, "slab", reference)])


def _softmax64(z):
    import numpy as np

    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def elementwise_case(depth, hw, channels, *, kind):
    """relu, ReluGrad, add, softmax, argmax, cast on (1, depth, hw, hw, channels), against NumPy."""
    import ml_dtypes
    import numpy as np
    import tensorflow as tf

    shape = [1, depth, hw, hw, channels]
    dtype = "bfloat16" if kind in ("add", "relu_grad") else "float32"
    x = tiled(shape, dtype, seed=1)
    other = tiled(shape, dtype, seed=3) if kind in ("add", "relu_grad") else None
    ops = {
        "relu": (lambda x: (tf.nn.relu(x),), lambda xs: np.maximum(xs, 0)),
        "relu_grad": (lambda x, dy: (tf.raw_ops.ReluGrad(gradients=dy, features=x),), lambda xs, dys: dys * (xs > 0)),
        "add": (lambda x, y: (tf.add(x, y),), lambda xs, ys: xs + ys),
        "softmax": (lambda x: (tf.nn.softmax(x, axis=-1),), _softmax64),
        "argmax": (lambda x: (tf.argmax(x, axis=-1),), lambda xs: xs.argmax(-1)),
        "cast": (lambda x: (tf.cast(x, tf.bfloat16),),
                 lambda xs: xs.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)),
    }
    fn, numpy_fn = ops[kind]
    inputs = [x] if other is None else [x, other]
    return Case(inputs, fn, depth,
                [Check("y", 0, "slab", lambda a, b: numpy_fn(*(f64(planes(t, a, b)) for t in inputs)))])


def concat_case(depth, hw, channels):
    import numpy as np
    import tensorflow as tf

    left = tiled([1, depth, hw, hw, channels // 2], seed=1)
    right = tiled([1, depth, hw, hw, channels - channels // 2], seed=3)
    def reference(a, b):
        return np.concatenate([f64(planes(left, a, b)), f64(planes(right, a, b))], axis=-1)

    return Case([left, right], lambda a, b: (tf.concat([a, b], axis=-1),), depth, [Check("y", 0, "slab", reference)])


def softmax_cross_entropy_case(depth, hw, channels, dtype="bfloat16"):
    import numpy as np
    import tensorflow as tf

    logits = tiled([1, depth, hw, hw, channels], dtype, seed=1)
    labels_block = tf.one_hot(tf.random.stateless_uniform([1, PERIOD, hw, hw], [3, 7], 0, channels, tf.int32), channels)
    labels = tiled([1, depth, hw, hw, channels], dtype, base=labels_block)

    def fn(labels, logits):  # the raw op takes (rows, classes), as tf.nn.softmax_cross_entropy_with_logits passes it
        loss, backprop = tf.raw_ops.SoftmaxCrossEntropyWithLogits(
            features=tf.reshape(logits, [-1, channels]), labels=tf.reshape(labels, [-1, channels]))
        return loss, backprop

    def loss(a, b):
        return -(f64(planes(labels, a, b)) * np.log(_softmax64(f64(planes(logits, a, b))))).sum(-1)

    def backprop(a, b):
        return _softmax64(f64(planes(logits, a, b))) - f64(planes(labels, a, b))

    return Case([labels, logits], fn, depth, [Check("loss", 0, "slab", loss), Check("backprop", 1, "slab", backprop)])


def one_hot_case(depth, hw, channels):
    import numpy as np
    import tensorflow as tf

    block = tf.random.stateless_uniform([1, PERIOD, hw, hw], [3, 7], 0, channels, tf.int32)
    labels = tiled([1, depth, hw, hw], "int32", base=block)
    return Case([labels], lambda t: (tf.one_hot(t, channels),), depth,
                [Check("y", 0, "slab", lambda a, b: np.eye(channels)[planes(labels, a, b).numpy()])])


def reduce_case(depth, hw, channels, *, kind):
    import tensorflow as tf

    x = tiled([1, depth, hw, hw, channels], seed=1)
    count = depth * hw * hw
    if kind == "reduce_sum":
        return Case([x], lambda x: (tf.reduce_sum(x, axis=[1, 2, 3]),), depth,
                    [Check("sum", 0, "sum", lambda a, b: f64(planes(x, a, b)).sum(axis=(1, 2, 3)))])

    def square_share(a, b):
        return (f64(planes(x, a, b)) ** 2).reshape(-1, channels).sum(0) / count

    mean = {}

    def variance_share(a, b):  # E[x^2] - mean^2, the mean's part spread evenly over the slabs
        if not mean:
            mean["m"] = _moments64(x, depth, channels)[0]
        return square_share(a, b) - mean["m"] ** 2 * (b - a) / depth

    return Case([x], lambda x: tf.nn.moments(x, axes=[0, 1, 2, 3]), depth,
                [Check("mean", 0, "sum", lambda a, b: f64(planes(x, a, b)).reshape(-1, channels).sum(0) / count),
                 Check("variance", 1, "sum", variance_share)])


def _spec(build, dtype, note, onednn=("1", "0"), **kwargs):
    return OpSpec(lambda d, hw, c: build(d, hw, c, **kwargs), dtype, onednn, note)


OPS = {
    "conv3d": _spec(conv3d_case, "float32", "tf.nn.conv3d 3x3x3 stride 1, 2->2 ch"),
    "conv3d_1x1": _spec(conv3d_case, "float32", "tf.nn.conv3d 1x1x1 (the head)", ksize=1),
    "conv3d_stride2": _spec(conv3d_case, "float32", "tf.nn.conv3d 3x3x3 stride 2 (input past 2^31)", stride=2),
    "conv3d_backprop_input": _spec(conv3d_backprop_input_case, "float32", "Conv3DBackpropInputV2 3x3x3 stride 1"),
    "conv3d_backprop_filter": _spec(conv3d_backprop_filter_case, "float32", "Conv3DBackpropFilterV2 3x3x3 stride 1"),
    "conv3d_transpose": _spec(conv3d_transpose_case, "float32", "conv3d_transpose 2x2x2 stride 2 (output past 2^31)"),
    "conv2d_planes": _spec(conv2d_planes_case, "float32", "tf.nn.conv2d 3x3 on the depth planes as a batch"),
    "conv2d_backprop_filter_planes": _spec(conv2d_backprop_filter_planes_case, "float32",
                                           "Conv2DBackpropFilter 3x3 on the planes (planewise weight gradient)"),
    "fused_bn_4d": _spec(fused_bn_case, "float32", "FusedBatchNormV3 training, (1, D, H*W, C) view"),
    "fused_bn_5d": _spec(fused_bn_case, "float32", "FusedBatchNormV3 training, 5-D NDHWC (Eigen with oneDNN on too)",
                         ("1",), five_d=True),
    "fused_bn_grad": _spec(fused_bn_grad_case, "bfloat16", "FusedBatchNormGradV3, (1, D, H*W, C) view"),
    "max_pool3d": _spec(max_pool3d_case, "float32", "max_pool3d 2x2x2 stride 2 (input past 2^31)"),
    "max_pool3d_grad": _spec(max_pool3d_grad_case, "float32", "MaxPool3DGrad (input and dx past 2^31)"),
    "relu": _spec(elementwise_case, "float32", "tf.nn.relu (Eigen with oneDNN on too)", ("1",), kind="relu"),
    "relu_grad": _spec(elementwise_case, "bfloat16", "ReluGrad", ("1",), kind="relu_grad"),
    "add": _spec(elementwise_case, "bfloat16", "tf.add of two full tensors", ("1",), kind="add"),
    "concat": _spec(concat_case, "float32", "tf.concat of two 1-channel tensors along channels (output past 2^31)",
                    ("1",)),
    "softmax": _spec(elementwise_case, "float32", "tf.nn.softmax over channels", kind="softmax"),
    "softmax_cross_entropy": _spec(softmax_cross_entropy_case, "bfloat16",
                                   "SoftmaxCrossEntropyWithLogits on (D*H*W, C) rows", ("1",)),
    "one_hot": _spec(one_hot_case, "float32", "tf.one_hot int32 labels -> 2 classes (output past 2^31)", ("1",)),
    "argmax": _spec(elementwise_case, "int64", "tf.argmax over channels", ("1",), kind="argmax"),
    "cast": _spec(elementwise_case, "bfloat16", "tf.cast float32 -> bfloat16", ("1",), kind="cast"),
    "reduce_sum": _spec(reduce_case, "float32", "tf.reduce_sum over space", ("1",), kind="reduce_sum"),
    "moments": _spec(reduce_case, "float32", "tf.nn.moments over space (Keras BatchNormalization)", ("1",),
                     kind="moments"),
    "conv3d_bf16": _spec(conv3d_case, "bfloat16", "the same in bfloat16: a limit in elements, not bytes?",
                         precision="bfloat16"),
}


def shared_interior(reference: Callable, depth: int) -> Callable:
    """reference(a, b), computed once per phase of the tiling for slabs away from both ends."""
    cache = {}

    def shared(a, b):
        if a < EDGE or b > depth - EDGE:  # padding or a clipped halo: this slab's own reference
            return reference(a, b)
        key = (a % (2 * PERIOD), b - a)  # an interior slab's input planes repeat with this phase
        if key not in cache:
            cache[key] = reference(a, b)
        return cache[key]

    return shared


def compare(case: Case, outputs) -> dict:
    """Max |error| and max |reference| per checked output, over every slab of its depth."""
    import numpy as np
    import tensorflow as tf

    results = {}
    for check in case.checks:
        reference = shared_interior(check.reference, case.depth)
        output, error, scale = outputs[check.index], 0.0, 0.0
        if check.kind == "sum":
            want = sum(np.asarray(reference(a, min(a + SLAB, case.depth))) for a in range(0, case.depth, SLAB))
            error, scale = float(np.abs(f64(output) - want).max()), float(np.abs(want).max())
        else:
            rows = tf.reshape(output, [case.depth, -1])
            for a in range(0, case.depth, SLAB):
                b = min(a + SLAB, case.depth)
                want = np.asarray(reference(a, b)).reshape(b - a, -1)
                error = max(error, float(np.abs(f64(rows[a:b]) - want).max()))
                scale = max(scale, float(np.abs(want).max()))
        results[check.name] = {"max_abs_err": error, "ref_max_abs": scale}
    return results


def child(request: dict) -> dict:
    """One op at one size, in its own process (``run_function``): run it, then check every output."""
    import tensorflow as tf

    from bigmem.memory.procfs import peak_rss_bytes

    geometry = SMALL if request["small"] else FULL
    spec = OPS[request["op"]]
    started = time.perf_counter()
    case = spec.build(request["depth"], geometry["hw"], geometry["channels"])
    result = {"shapes": [list(t.shape) for t in case.inputs], "input_dtypes": [t.dtype.name for t in case.inputs],
              "setup_s": round(time.perf_counter() - started, 2)}
    started = time.perf_counter()
    try:
        outputs = tf.function(case.fn)(*case.inputs)
    except tf.errors.OpError as error:  # a kernel that refuses the size instead of crashing
        return {**result, "error": f"{type(error).__name__}: {error.message.splitlines()[0][:300]}"}
    result["op_s"] = round(time.perf_counter() - started, 2)
    result["output_shapes"] = [list(t.shape) for t in outputs]
    started = time.perf_counter()
    result["outputs"] = compare(case, outputs)
    result["check_s"] = round(time.perf_counter() - started, 2)
    result["child_peak_rss_bytes"] = peak_rss_bytes()
    return result


# ---------------------------------------------------------------- parent side


def onednn_kinds(stdout: str) -> list[str]:
    """Primitive kinds oneDNN executed, from ONEDNN_VERBOSE=1 lines ("onednn_verbose,...,exec,cpu,KIND,...")."""
    kinds = set()
    for line in stdout.splitlines():
        fields = line.split(",")
        if fields[0] == "onednn_verbose" and "exec" in fields:
            at = fields.index("exec")
            if at + 2 < len(fields):
                kinds.add(fields[at + 2])
    return sorted(kinds)


def run_case(op: str, size: str, onednn: str, args) -> dict:
    """One (op, size, oneDNN setting) in a fresh process; how it ended, its peak and what it reported."""
    geometry = SMALL if args.quick else FULL
    depth = geometry["depths"][size]
    elements = depth * geometry["hw"] ** 2 * geometry["channels"]
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn, "ONEDNN_VERBOSE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = run_function(child, {"op": op, "depth": depth, "small": args.quick}, env=env, timeout_s=args.timeout_s,
                       what=f"{op} at D={depth}, oneDNN={onednn}")
    row = {"op": op, "size": size, "depth": depth, "elements": elements, "over_2_31": elements > INT32_LIMIT,
           "dtype": OPS[op].dtype, "onednn": onednn, "exit_code": run.returncode, "wall_s": round(run.wall_s, 1),
           "peak_rss_bytes": run.peak_rss_bytes, "onednn_primitives": onednn_kinds(run.stdout), **(run.result or {})}
    row["outcome"], row["ran"] = classify(row, run)
    if not row["ran"]:  # what the process said last (TF's fatal log lines name the failed check)
        row["stderr_tail"] = [line[:400] for line in run.stderr_tail(4)]
    return row


def classify(row: dict, run: ChildRun) -> tuple[str, bool]:
    if run.returncode < 0 or run.timed_out:  # "segfault (-11)", "timeout (-9)", "killed (out of memory?) (-9)"
        return run.failure(), False
    if run.returncode or "outputs" not in row:
        return f"error: {row.get('error') or run.failure()}", False
    rel = max(o["max_abs_err"] / max(o["ref_max_abs"], 1e-30) for o in row["outputs"].values())
    row["max_rel_err"] = rel
    row["max_abs_err"] = max(o["max_abs_err"] for o in row["outputs"].values())
    return ("correct" if rel <= TOLERANCE[row["dtype"]] else "WRONG"), True


def summarize(rows: list[dict]) -> list[dict]:
    """Per (op, dtype, oneDNN): the largest size that ran correctly and the smallest that did not."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["op"], row["dtype"], row["onednn"]), []).append(row)
    summary = []
    for (op, dtype, onednn), runs in groups.items():
        good = [r for r in runs if r["outcome"] == "correct"]
        bad = [r for r in runs if r["outcome"] != "correct"]
        largest = max(good, key=lambda r: r["elements"], default=None)
        smallest = min(bad, key=lambda r: r["elements"], default=None)
        beyond = largest is not None and largest["over_2_31"]
        summary.append({
            "op": op, "dtype": dtype, "onednn": onednn,
            "largest_ok": largest and {k: largest[k] for k in ("elements", "depth", "max_abs_err", "max_rel_err")},
            "smallest_failed": smallest and {k: smallest[k] for k in ("elements", "depth", "exit_code", "outcome")},
            "verdict": "handles > 2^31" if beyond and smallest is None else
                       "needs partitioning" if smallest is not None and smallest["over_2_31"] else "inconclusive"})
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick={}, quick_aliases=("--small",),
                          quick_help="tiny shapes (1, 24..30, 32, 32, 2): checks the script (also --small)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated; default all: " + ",".join(OPS))
    parser.add_argument("--sizes", default="auto", help="auto (above, then below if above fails), or below/above")
    parser.add_argument("--onednn", default="auto", help="auto (1 and 0 where oneDNN has a kernel), or 1, 0, 1,0")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per child")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(OPS))
    if unknown:
        parser.error(f"unknown --ops {','.join(unknown)}; valid: {','.join(OPS)}")
    from rich.console import Console
    from rich.table import Table

    from bigmem.memory.calibration import machine_cpu_model, tensorflow_version

    console = Console(soft_wrap=True, width=200)
    rows = []
    for op in args.ops.split(","):
        settings = OPS[op].onednn if args.onednn == "auto" else tuple(args.onednn.split(","))
        # one turn per op (all its settings and sizes); tiny tensors need no turn on the machine's memory
        with heavy_turn(not args.quick, lambda message: console.print(message, style="dim")):
            for onednn in settings:
                for size in ["above", "below"] if args.sizes == "auto" else args.sizes.split(","):
                    row = run_case(op, size, onednn, args)
                    rows.append(row)
                    err = f", rel err {row['max_rel_err']:.2e}" if "max_rel_err" in row else ""
                    console.print(f"{op} {row['dtype']} oneDNN={onednn} D={row['depth']} ({row['elements']:.3e}): "
                                  f"{row['outcome']}{err}, {row['wall_s']} s, oneDNN ran {row['onednn_primitives']}",
                                  style="dim")
                    if args.sizes == "auto" and row["outcome"] == "correct":
                        break
    table = Table(title="Runs (each in its own process)")
    for column in ("op", "dtype", "oneDNN", "D", "elements", "outcome", "exit", "max abs err", "rel err",
                   "op s", "peak RSS GiB", "oneDNN primitives"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["op"], r["dtype"], r["onednn"], str(r["depth"]), f"{r['elements']:.3e}", r["outcome"],
                      str(r["exit_code"]), f"{r.get('max_abs_err', float('nan')):.2e}",
                      f"{r.get('max_rel_err', float('nan')):.2e}", str(r.get("op_s", "-")),
                      f"{r['peak_rss_bytes'] / 2**30:.1f}",
                      ",".join(r["onednn_primitives"]) or ("-" if r["ran"] else "? (lost in the crash)"))
    console.print(table)
    summary = summarize(rows)
    table = Table(title=f"Limits per op (TF {tensorflow_version()}; 2^31 = {INT32_LIMIT:.4e} elements)")
    for column in ("op", "dtype", "oneDNN", "largest that ran (elements, max abs err)", "smallest that failed",
                   "verdict"):
        table.add_column(column, justify="right")
    for s in summary:
        ok, bad = s["largest_ok"], s["smallest_failed"]
        table.add_row(s["op"], s["dtype"], s["onednn"],
                      f"{ok['elements']:.3e} (D={ok['depth']}), {ok['max_abs_err']:.2e}" if ok else "-",
                      f"{bad['elements']:.3e} (D={bad['depth']}): {bad['outcome']}" if bad else "-", s["verdict"])
    console.print(table)
    geometry = SMALL if args.quick else FULL
    report = {"machine": {"host": socket.gethostname(), "cpu": machine_cpu_model(), "tensorflow": tensorflow_version()},
              "command": command_line(__file__, argv),
              "geometry": geometry, "period_planes": PERIOD, "slab_planes": SLAB, "tolerance": TOLERANCE,
              "notes": {op: OPS[op].note for op in args.ops.split(",")}, "runs": rows, "summary": summary}
    write_results("kernel_limits-small" if args.quick else "kernel_limits", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
