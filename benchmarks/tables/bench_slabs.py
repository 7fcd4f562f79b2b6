"""What depth slabs cost, and proof that every partitioned op is right past 2^31 elements (bigmem/nets/slabs.py).

    python benchmarks/tables/bench_slabs.py [--shared] [--proof] [--quick] [--ops conv3d,...] [--warmup 2] [--repeats 7]
        [--out DIR]

``--shared``: each op forward + backward at one size both paths run (fp32, (1, 128, 128, 128, 32)
or the op's neighbour in a U-Net), unpartitioned (TF's op; for the norm, the path NormActivation
takes below the limit) against partitioned (the slab function with the limit lowered by
BIGMEM_MAX_KERNEL_ELEMENTS so it runs in 4-5 slabs). Median and spread of ``--repeats`` timed
calls after ``--warmup``; GFLOP/s for the convolutions (2 x multiply-adds forward, x 3 forward +
backward); peak resident bytes of the child (VmHWM, reset once the inputs exist), and how far the
partitioned peak is above the unpartitioned one, against one slab (the limit x 4 bytes). The
timed function returns sum(y) + the sums of the gradients: it depends on the forward output and
on every gradient, so nothing is pruned; the gradients are taken for a fixed dy
(``output_gradients``), so no loss adds work of its own. The partitioned child also times its copy
floor: writing tensors of x's and y's sizes into new buffers with InplaceUpdate, as every slab
path writes its output and its input gradient (no TF kernel writes into part of an existing
tensor); ``bound`` = unpartitioned / (unpartitioned + copy floor) is the throughput a slab path
built from TF's kernels reaches if everything else cost it no more than the unpartitioned op.

``--proof``: each partitioned op forward and backward on a tensor past 2^31 elements, with slabs
of 2^27 elements (see PROOF), against a reference computed piece by piece with TF's unpartitioned
ops on sub-volumes (windows of WINDOW planes, every window of the volume): forward = the op on
the window plus the halo it reads; input gradient = autodiff of the op on a haloed window with dy
zero-padded outside the wanted outputs, interior planes compared; weight gradient = the float64
sum over disjoint output windows of that autodiff. The norm's reference: float64 statistics per
channel accumulated window by window, then normalised windows (and its backward from float64
sums of dz and dz * xhat). Then one conv -> instance norm -> ReLU block (bigmem's Conv3D and
NormActivation layers), forward and backward chained, against the same block computed window by
window by hand. Data: a random block of PERIOD planes tiled along depth (tile allocates only its
output; PERIOD = 43 divides the depths but not 1024, the plane where a wrapped int32 index would
land); dy is tiled the same way and generated inside the timed function only once the forward
output has been summed, so the forward output's buffer can go first. Memory: each fp32 tensor
past 2^31 elements is 8.6 GB; the norm's backward holds its input, dy and dx (3 x 8.6 GB = 25.8
GB > 24 GiB), so the norm's backward and the block run in bfloat16 (an element limit, not a byte
limit: the kernels index elements). The stride-1 conv goes 1 -> 4 channels on half the depth (the
output past 2^31, x and dx a quarter of it); the stride-2 conv 2 -> 1 (x and dx past 2^31).

Every child runs under an exclusive lock on /tmp/bigmem-heavy.lock (it never shares the machine's
memory with another multi-GB measurement). Prints tables and writes JSON keyed by machine (never
run by pytest).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, command_line, heavy_turn, run_function, spread, time_calls, write_results

LIMIT_VARIABLE = "BIGMEM_MAX_KERNEL_ELEMENTS"  # bigmem.nets.slabs.LIMIT_ENVIRONMENT_VARIABLE
INT32_LIMIT = 2**31
# TF's oneDNN CPU allocator (a BFC allocator) counts every region it has reserved, used or not,
# against a cap of the physical RAM, and grows regions by doubling: after x (8.6 GB) it holds a
# 17 GB region and refuses a second 8.6 GB tensor on this 24 GiB machine with 8 GB free (seen:
# OOM at 13-17 GB resident). The proof children raise the cap (TF_MKL_ALLOC_MAX_BYTES); what
# is resident is still bounded by the RAM, and the peak reported is the resident one.
ALLOCATOR_CAP_BYTES = 128 * 2**30

# --shared: (1, edge, edge, edge, channels) and the lowered limit that gives 4-5 slabs per op
# (2^24 elements = 32 planes of 128^2 x 32).
SHARED = {"edge": 128, "channels": 32, "limit": 2**24}
SHARED_SMALL = {"edge": 32, "channels": 8, "limit": 2**16}
# --proof: (1, depth, hw, hw, C); 1032 x 1024^2 x 2 = 2.16e9 > 2^31. No limit override: the shipped one.
# Planes are compared in every ``every``-th window and the last (sums such as the weight gradient
# and the statistics always take every window); at full size every 3rd keeps the run near 30 min.
# The limit is lowered to 2^27 elements (512 MiB fp32 slab temporaries instead of 2 GiB): next to
# x + dy + dx = 17.3 GB of fp32 tensors past 2^31 there is little room on 24 GiB. (The runs with the
# shipped 2^29 failed on the allocator cap below, before it was raised; they were not repeated.)
# The slabs' framing is the same code at either size.
PROOF = {"depth": 1032, "hw": 1024, "period": 43, "window": 16, "every": 3, "limit": 2**27}
PROOF_SMALL = {"depth": 40, "hw": 24, "period": 5, "window": 4, "every": 1, "limit": 2**14}
# bfloat16 checks run once more on this small volume with the limit lifted (no slabs): the error
# bfloat16 rounding alone gives against the same reference (a ReLU gate can flip where the
# pre-activation is within one rounding of 0, and moves dx by a whole |kernel x dc| there).
UNPARTITIONED_FLOOR = {"depth": 86, "hw": 128, "period": 43, "window": 16, "every": 1}
# max |error| / max |reference| within which a result counts as right (as bench_kernel_limits.py):
# a few units in the last place of long float32 sums; one bfloat16 rounding (8-bit mantissa).
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
EPSILON = 1e-5  # the instance norm's (bigmem.nets.blocks.INSTANCE_NORM_EPSILON)
GAMMA, BETA = (1.3, 0.7), (0.1, -0.2)  # per channel: the norm's scale and shift enter every check


# ---- child side: shared size ---------------------------------------------------------------------


def _shared_case(op: str, path: str, edge: int, channels: int, depth: int | None = None):
    """(fn, inputs, dy, forward multiply-adds) of one op on (1, depth or edge, edge, edge, channels)."""
    import tensorflow as tf

    from bigmem.nets.norm_act import instance_norm_activation, norm_activation_large, norm_activation_slabs
    from bigmem.nets.slabs import conv3d_slabs, conv3d_transpose_slabs, max_pool3d_slabs

    def normal(shape, seed, scale=1.0):
        # A block of 8 random planes tiled along depth: tile allocates only its output, so making
        # the inputs leaves no high-water mark of its own above the op's (a random tensor this
        # size takes temporaries of its size, and the peak compared would be theirs).
        shape = tuple(shape)
        if len(shape) < 5 or shape[1] <= 8:
            return tf.random.stateless_normal(shape, [seed, 7]) * scale
        block = tf.random.stateless_normal((shape[0], 8, *shape[2:]), [seed, 7]) * scale
        return tf.tile(block, [1, -(-shape[1] // 8), 1, 1, 1])[:, :shape[1]]

    depth = depth or edge
    x = normal((1, depth, edge, edge, channels), 1)
    half = edge // 2
    partitioned = path != "unpartitioned"
    if op in ("conv3d", "conv3d_deep", "conv3d_stride2"):
        stride, out_channels = (2, 2 * channels) if op == "conv3d_stride2" else (1, channels)
        kernel = normal((3, 3, 3, channels, out_channels), 2, (27 * channels) ** -0.5)
        out_shape = (1, depth // stride, edge // stride, edge // stride, out_channels)

        def fn(x, kernel):
            if partitioned:
                return conv3d_slabs(x, kernel, stride)
            return tf.nn.conv3d(x, kernel, [1, stride, stride, stride, 1], "SAME")

        return fn, [x, kernel], normal(out_shape, 3), math.prod(out_shape[1:4]) * 27 * channels * out_channels
    if op == "conv3d_transpose":  # the decoder's upsampling: 2C -> C, kernel 2 = stride 2
        x = normal((1, half, half, half, 2 * channels), 1)
        kernel = normal((2, 2, 2, channels, 2 * channels), 2, (16 * channels) ** -0.5)

        def fn(x, kernel):
            if partitioned:
                return conv3d_transpose_slabs(x, kernel, 2)
            return tf.nn.conv3d_transpose(x, kernel, (1, edge, edge, edge, channels), [1, 2, 2, 2, 1], "SAME")

        return fn, [x, kernel], normal((1, edge, edge, edge, channels), 3), half**3 * 8 * 2 * channels * channels
    if op == "max_pool3d":
        def fn(x):
            return max_pool3d_slabs(x, 2) if partitioned else tf.nn.max_pool3d(x, 2, 2, "VALID")

        return fn, [x], normal((1, half, half, half, channels), 3), None
    if op in ("norm_relu", "norm_relu_large"):
        gamma, beta = tf.fill([channels], GAMMA[0]), tf.fill([channels], BETA[0])
        options = {"epsilon": EPSILON, "activation": "relu", "negative_slope": 0.0}

        def fn(x, gamma, beta):
            if partitioned:
                return norm_activation_slabs(x, gamma, beta, groups=channels, **options)
            if op == "norm_relu_large":
                return norm_activation_large(x, gamma, beta, groups=channels, **options)
            return instance_norm_activation(x, gamma, beta, **options)

        return fn, [x, gamma, beta], normal(x.shape, 3), None
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(SHARED_OPS)}")


def child_shared(request: dict) -> dict:
    """--shared: one op on one path, in its own process (``run_function``): timed steps, peak, copy floor."""
    from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
    from bigmem.sysinfo import tensorflow_description
    from bigmem.tfenv import import_tensorflow

    tf = import_tensorflow()
    fn, inputs, dy, macs = _shared_case(request["op"], request["path"], request["edge"], request["channels"],
                                        request.get("depth"))
    forward = tf.function(fn).get_concrete_function(*inputs)
    slabs = sum(op.type == "InplaceUpdate" for op in forward.graph.get_operations())

    @tf.function
    def step(inputs, dy):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = fn(*inputs)
        total = tf.reduce_sum(y)
        # dy becomes available once the forward is done, as in a training step (where it comes
        # from the layers above): given at once, the executor would run the backward beside the
        # forward, and the peak would hold both paths' temporaries and outputs together.
        with tf.control_dependencies([total]):
            dy = tf.identity(dy)
        grads = tape.gradient(y, inputs, output_gradients=dy)
        # Depends on the forward output and on every gradient: nothing of the step is pruned.
        return total + tf.add_n([tf.reduce_sum(g) for g in grads])

    reset = reset_peak_rss()
    baseline_bytes = rss_bytes()
    times = time_calls(lambda: step(inputs, dy).numpy(), repeats=request["repeats"], warmup=request["warmup"]).times_s
    peak = peak_rss_bytes()
    copy = {} if request["path"] == "unpartitioned" else {
        "copy_s": _copy_floor_s([inputs[0], dy], request["warmup"], request["repeats"])}
    return {"times_s": times, "forward_macs": macs, "slabs": slabs or 1, "peak_bytes": peak,
            "baseline_bytes": baseline_bytes, "op_peak_bytes": peak - baseline_bytes, "peak_reset": reset,
            **copy, "tensorflow": tensorflow_description()}


def _copy_floor_s(tensors, warmup: int, repeats: int) -> float:
    """Median seconds to write each tensor, one after another, into a new buffer with InplaceUpdate (as PlaneWriter)."""
    import tensorflow as tf

    @tf.function
    def copy(tensors):
        total, after = tf.constant(0.0), []
        for t in tensors:
            rows = tf.reshape(t, (t.shape[0] * t.shape[1], -1))
            with tf.control_dependencies(after):
                out = tf.raw_ops.InplaceUpdate(x=tf.raw_ops.Empty(shape=rows.shape, dtype=rows.dtype),
                                               i=tf.range(rows.shape[0]), v=rows)
            after = [out]
            total += tf.reduce_sum(out[:1, :1])
        return total

    return time_calls(lambda: copy(tensors).numpy(), repeats=repeats, warmup=warmup).spread.median


# ---- child side: the proof past 2^31 --------------------------------------------------------------


class MaxError:
    """Max |got - want| and max |want| over every window compared (float64)."""

    def __init__(self):
        self.abs_err, self.ref_max, self.windows = 0.0, 0.0, 0

    def add(self, got, want) -> None:
        import tensorflow as tf

        got, want = tf.cast(got, tf.float64), tf.cast(want, tf.float64)
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"compared shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
        self.abs_err = max(self.abs_err, float(tf.reduce_max(tf.abs(got - want))))
        self.ref_max = max(self.ref_max, float(tf.reduce_max(tf.abs(want))))
        self.windows += 1

    def to_dict(self) -> dict:
        return {"max_abs_err": self.abs_err, "ref_max_abs": self.ref_max,
                "rel_err": self.abs_err / max(self.ref_max, 1e-30), "windows": self.windows}


def _block(shape, seed, dtype="float32", low=-1.0, high=2.0):
    """A random block of ``shape`` (its depth is the tiling period), cast to ``dtype``."""
    import tensorflow as tf

    return tf.cast(tf.random.stateless_uniform(shape, [seed, 7], low, high), dtype)


def tiled(block, depth: int):
    """The block tiled along depth to ``depth`` planes (a multiple of its period): allocates only the output."""
    import tensorflow as tf

    period = block.shape[1]
    if depth % period:
        raise ValueError(f"depth {depth} is not a multiple of the tiling period {period}")
    return tf.tile(block, [1, depth // period, 1, 1, 1])


def tiled_planes(block, start: int, stop: int):
    """Planes [start, stop) of the tiled block, made from the block alone."""
    import numpy as np
    import tensorflow as tf

    return tf.gather(block, np.arange(start, stop) % block.shape[1], axis=1)


def planes(t, start: int, stop: int):
    return t[:, start:stop]


def _windows(length: int, size: int, every: int = 1):
    """[start, stop) of consecutive ``size``-plane windows: every ``every``-th one and the last."""
    windows = [(a, min(a + size, length)) for a in range(0, length, size)]
    return [w for i, w in enumerate(windows) if i % every == 0 or i == len(windows) - 1]


def conv_window(x_block, depth: int, kernel, stride: int, o0: int, o1: int, dy=None, dtype="float32"):
    """Reference for output planes [o0, o1) of a "SAME" 3x3x3 conv (stride 1 or 2, even depth) of the tiled input.

    TF's conv3d on the input planes those outputs read (window [lo, hi)); with ``dy`` (o1 - o0
    output planes), also autodiff of sum(y * dy) with dy zero-padded to the window's other outputs.

    The gradients are taken in float32 of the values rounded to ``dtype`` (so the reference is at
    least as exact as the op under test): TF's bfloat16 3-D weight gradient crashes on an Intel
    Xeon with AMX at planes of 512^2 and wider (SIGSEGV or SIGILL, TF 2.21, 2026-12-01), and the
    proof's planes are 1024^2.

    Returns:
        (y planes [o0, o1) in ``dtype``, lo, dx over input planes [lo, hi) or None, dkernel or None).
    """
    import tensorflow as tf

    if stride == 1:  # output o reads input planes o - 1 .. o + 1; window output j is output lo + j
        lo, hi = max(o0 - 1, 0), min(o1 + 1, depth)
        first = o0 - lo
    else:  # TF pads one plane after an even depth: output o reads 2o .. 2o + 2; window output j is o0 + j
        lo, hi = 2 * o0, min(2 * o1 + 2, depth)
        first = 0
    x, kernel = tf.cast(tiled_planes(x_block, lo, hi), dtype), tf.cast(kernel, dtype)
    y = tf.nn.conv3d(x, kernel, [1, stride, stride, stride, 1], "SAME")
    wanted = y[:, first:first + o1 - o0]
    if dy is None:
        return wanted, lo, None, None
    x, kernel = tf.cast(x, tf.float32), tf.cast(kernel, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        y = tf.nn.conv3d(x, kernel, [1, stride, stride, stride, 1], "SAME")
        padded = tf.pad(tf.cast(tf.cast(dy, dtype), tf.float32),
                        [[0, 0], [first, y.shape[1] - first - (o1 - o0)], [0, 0], [0, 0], [0, 0]])
        loss = tf.reduce_sum(y * padded)
    dx, dkernel = tape.gradient(loss, [x, kernel])
    return wanted, lo, dx, dkernel


def _readers(i0: int, i1: int, stride: int, out_depth: int) -> tuple[int, int]:
    """Output planes [o0, o1) of a "SAME" 3x3x3 conv that read any input plane in [i0, i1)."""
    if stride == 1:
        return max(i0 - 1, 0), min(i1 + 1, out_depth)
    return max(-(-(i0 - 2) // 2), 0), min((i1 - 1) // 2 + 1, out_depth)


# Each check runs the backward pass before the forward one. TF's CPU allocator (a BFC allocator
# capped at the physical RAM) never returns a region: after a forward call the freed y is a hole
# that dx (smaller) lands in, and dy (as large as y) then needs a new region, which the cap
# refuses (seen: OOM allocating dx of the stride-1 conv). Backward first, y and dy take the same
# hole in turn, and the forward's y later takes it again.

def run_backward(fn, inputs, dy_block, out_depth: int, variables=()):
    """Gradients of fn(*inputs) for dy = the tiled dy_block (inputs, then ``variables``); dy made once y is whole."""
    import tensorflow as tf

    @tf.function
    def backward(inputs, dy_block):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = fn(*inputs)
        anchor = tf.reduce_sum(tf.cast(y[:, -1:], tf.float32))  # y is whole before this; nothing else holds it
        with tf.control_dependencies([anchor]):
            dy = tiled(dy_block, out_depth)
        return anchor, tape.gradient(y, [*inputs, *variables], output_gradients=dy)

    return backward(inputs, dy_block)[1]


def run_forward(fn, inputs) -> tuple:
    """(y, slabs): fn(*inputs) in one tf.function, and how many slab writes its graph makes."""
    import tensorflow as tf

    forward = tf.function(fn)
    slabs = sum(op.type == "InplaceUpdate" for op in forward.get_concrete_function(*inputs).graph.get_operations())
    return forward(*inputs), slabs


def proof_conv(g: dict, stride: int, in_channels: int, out_channels: int, *, depth_divisor: int = 1,
               dtype: str = "float32") -> dict:
    """conv3d_slabs, 3x3x3 "SAME", on (1, depth / depth_divisor, hw, hw, in_channels) in ``dtype``."""
    import numpy as np
    import tensorflow as tf

    from bigmem.nets.slabs import conv3d_slabs

    depth, hw, period, window = g["depth"] // depth_divisor, g["hw"], g["period"], g["window"]
    out_depth, out_hw = depth // stride, hw // stride
    x_block = _block((1, period, hw, hw, in_channels), 1, dtype)
    dy_block = _block((1, period, out_hw, out_hw, out_channels), 3, dtype, low=-1.0, high=1.0)
    kernel = tf.random.stateless_normal((3, 3, 3, in_channels, out_channels), [2, 7]) / (27 * in_channels) ** 0.5
    kernel = tf.cast(tf.cast(kernel, dtype), tf.float32)  # the reference convolves in float32 with the same values
    x = tiled(x_block, depth)

    def fn(x, kernel):
        return conv3d_slabs(x, tf.cast(kernel, dtype), stride)

    errors = {"y": MaxError(), "dx": MaxError(), "dkernel": MaxError()}
    dx, dkernel = run_backward(fn, [x, kernel], dy_block, out_depth)  # first: see the note above run_backward
    for i0, i1 in _windows(depth, window, g["every"]):
        o0, o1 = _readers(i0, i1, stride, out_depth)
        _, lo, dx_want, _ = conv_window(x_block, depth, kernel, stride, o0, o1, tiled_planes(dy_block, o0, o1))
        errors["dx"].add(planes(dx, i0, i1), dx_want[:, i0 - lo:i1 - lo])
    del dx
    y, slabs = run_forward(fn, [x, kernel])
    dkernel_want = np.zeros(kernel.shape)
    for o0, o1 in _windows(out_depth, window):  # forward, and the weight gradient's share of each output window
        want, _, _, dkernel_share = conv_window(x_block, depth, kernel, stride, o0, o1,
                                                tiled_planes(dy_block, o0, o1))
        errors["y"].add(planes(y, o0, o1), want)
        dkernel_want += dkernel_share.numpy().astype(np.float64)
    errors["dkernel"].add(dkernel, dkernel_want)
    shapes = {"x": x.shape.as_list(), "y": y.shape.as_list()}
    return {"shapes": shapes, "slabs": slabs, "errors": {k: v.to_dict() for k, v in errors.items()}}


def proof_conv_transpose(g: dict) -> dict:
    """conv3d_transpose_slabs 2x2x2 stride 2, 2 -> 2 channels: output (1, depth, hw, hw, 2) past 2^31."""
    import numpy as np
    import tensorflow as tf

    from bigmem.nets.slabs import conv3d_transpose_slabs

    depth, hw, period, window = g["depth"], g["hw"], g["period"], g["window"]
    x_block = _block((1, period, hw // 2, hw // 2, 2), 1)
    dy_block = _block((1, period, hw, hw, 2), 3, low=-1.0, high=1.0)
    kernel = tf.random.stateless_normal((2, 2, 2, 2, 2), [2, 7]) / 4.0  # (k, k, k, out, in)
    x = tiled(x_block, depth // 2)

    def fn(x, kernel):
        return conv3d_transpose_slabs(x, kernel, 2)

    def reference(i0, i1):  # input planes [i0, i1) write output planes [2 i0, 2 i1) alone
        xs = tiled_planes(x_block, i0, i1)
        dys = tiled_planes(dy_block, 2 * i0, 2 * i1)
        with tf.GradientTape() as tape:
            tape.watch([xs, kernel])
            ys = tf.nn.conv3d_transpose(xs, kernel, (1, 2 * (i1 - i0), hw, hw, 2), [1, 2, 2, 2, 1], "SAME")
            loss = tf.reduce_sum(ys * dys)
        return (ys, *tape.gradient(loss, [xs, kernel]))

    errors = {"y": MaxError(), "dx": MaxError(), "dkernel": MaxError()}
    dx, dkernel = run_backward(fn, [x, kernel], dy_block, depth)  # first: see the note above run_backward
    for i0, i1 in _windows(depth // 2, window // 2, g["every"]):
        errors["dx"].add(planes(dx, i0, i1), reference(i0, i1)[1])
    del dx
    y, slabs = run_forward(fn, [x, kernel])
    dkernel_want = np.zeros(kernel.shape)
    for i0, i1 in _windows(depth // 2, window // 2):
        want, _, dkernel_share = reference(i0, i1)
        errors["y"].add(planes(y, 2 * i0, 2 * i1), want)
        dkernel_want += dkernel_share.numpy().astype(np.float64)
    errors["dkernel"].add(dkernel, dkernel_want)
    shapes = {"x": x.shape.as_list(), "y": y.shape.as_list()}
    return {"shapes": shapes, "slabs": slabs, "errors": {k: v.to_dict() for k, v in errors.items()}}


def proof_max_pool(g: dict, dtype: str = "float32") -> dict:
    """max_pool3d_slabs 2x2x2 on (1, depth, hw, hw, 2) past 2^31; reference: TF's max_pool3d and its gradient."""
    from bigmem.nets.slabs import max_pool3d_slabs

    depth, hw, period, window = g["depth"], g["hw"], g["period"], g["window"]
    x_block = _block((1, period, hw, hw, 2), 1, dtype)
    dy_block = _block((1, period, hw // 2, hw // 2, 2), 3, dtype, low=-1.0, high=1.0)
    x = tiled(x_block, depth)

    def fn(x):
        return max_pool3d_slabs(x, 2)

    return check_pool(fn, x, x_block, dy_block, window, g["every"])


def check_pool(fn, x, x_block, dy_block, window: int, every: int) -> dict:
    """A 2x2x2 max pool ``fn`` of the tiled ``x``, forward and backward, against TF's pool on windows.

    Output planes [o0, o1) read input planes [2 o0, 2 o1) alone; dy is the tiled ``dy_block``.
    """
    import tensorflow as tf

    depth = x.shape[1]

    def reference(o0, o1):
        xs = tiled_planes(x_block, 2 * o0, 2 * o1)
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = tf.nn.max_pool3d(xs, 2, 2, "VALID")
        return ys, tape.gradient(ys, xs, output_gradients=tiled_planes(dy_block, o0, o1))

    errors = {"y": MaxError(), "dx": MaxError()}
    (dx,) = run_backward(fn, [x], dy_block, depth // 2)  # first: see the note above run_backward
    for o0, o1 in _windows(depth // 2, window // 2, every):
        errors["dx"].add(planes(dx, 2 * o0, 2 * o1), reference(o0, o1)[1])
    del dx
    y, slabs = run_forward(fn, [x])
    for o0, o1 in _windows(depth // 2, window // 2, every):
        errors["y"].add(planes(y, o0, o1), reference(o0, o1)[0])
    shapes = {"x": x.shape.as_list(), "y": y.shape.as_list()}
    return {"shapes": shapes, "slabs": slabs, "errors": {k: v.to_dict() for k, v in errors.items()}}


class NormReference:
    """Instance norm + ReLU by hand: float64 statistics per channel accumulated window by window.

    ``planes_of(a, b)`` gives the norm's input planes [a, b) (any dtype). The gate of the ReLU is
    taken on z = (x - mean) * scale + beta in float64, as the op takes it in float32 on the centred
    slab. (Taking it as x * scale + shift in bfloat16 gated whole bfloat16 values of x the other way:
    each such value holds ~10^6 voxels of a 2^31-element tensor, and the tiling repeats them, so the
    block's dbeta came out 5.8% and its dx 25% off against a correct op.)
    """

    def __init__(self, planes_of, depth: int, window: int, channels: int):
        import numpy as np
        import tensorflow as tf

        self.planes_of, self.depth, self.window = planes_of, depth, window
        total, squares, count = np.zeros(channels), np.zeros(channels), 0
        for a, b in _windows(depth, window):
            xs = tf.reshape(tf.cast(planes_of(a, b), tf.float64), (-1, channels))
            total += tf.reduce_sum(xs, 0).numpy()
            squares += tf.reduce_sum(xs * xs, 0).numpy()
            count += xs.shape[0]
        self.count = count
        self.mean = total / count
        self.rstd = 1.0 / np.sqrt(squares / count - self.mean**2 + EPSILON)
        self.gamma, self.beta = np.array(GAMMA[:channels]), np.array(BETA[:channels])
        self.sum_dz = self.sum_dz_xhat = None

    def _pieces(self, a, b, dy=None):
        import tensorflow as tf

        xs = self.planes_of(a, b)
        xhat = (tf.cast(xs, tf.float64) - self.mean) * self.rstd
        y = tf.nn.relu(xhat * self.gamma + self.beta)
        if dy is None:
            return y
        z = xhat * self.gamma + self.beta
        dz = tf.where(z > 0, tf.cast(dy, tf.float64), tf.zeros((), tf.float64))
        return y, xhat, dz

    def forward(self, a, b):
        return self._pieces(a, b)

    def accumulate(self, dy_of) -> None:
        """The sums of dz and dz * xhat per channel over the whole volume, window by window (float64)."""
        import tensorflow as tf

        self.sum_dz = self.sum_dz_xhat = 0.0
        for a, b in _windows(self.depth, self.window):
            _, xhat, dz = self._pieces(a, b, dy_of(a, b))
            self.sum_dz = self.sum_dz + tf.reduce_sum(dz, axis=(0, 1, 2, 3)).numpy()
            self.sum_dz_xhat = self.sum_dz_xhat + tf.reduce_sum(dz * xhat, axis=(0, 1, 2, 3)).numpy()

    def input_grad(self, a, b, dy):
        """dx of planes [a, b): gamma rstd (dz - mean(dz) - xhat mean(dz xhat)); needs ``accumulate`` first."""
        _, xhat, dz = self._pieces(a, b, dy)
        return self.gamma * self.rstd * (dz - self.sum_dz / self.count - xhat * self.sum_dz_xhat / self.count)


def proof_norm(g: dict, dtype: str, backward: bool) -> dict:
    """norm_activation_slabs (instance norm + ReLU) on (1, depth, hw, hw, 2) past 2^31."""
    import tensorflow as tf

    from bigmem.nets.norm_act import norm_activation_slabs

    depth, hw, period, window = g["depth"], g["hw"], g["period"], g["window"]
    x_block = _block((1, period, hw, hw, 2), 1)
    # dy correlated with x, so that sum(dz * xhat) does not cancel to a tiny number
    dy_block = tf.cast(0.5 * x_block + _block(x_block.shape, 3, low=-1.0, high=1.0), dtype)
    x_block = tf.cast(x_block, dtype)
    gamma, beta = tf.constant(GAMMA), tf.constant(BETA)
    x = tiled(x_block, depth)

    def fn(x, gamma, beta):
        return norm_activation_slabs(x, gamma, beta, groups=2, epsilon=EPSILON, activation="relu",
                                     negative_slope=0.0)

    reference = NormReference(lambda a, b: tiled_planes(x_block, a, b), depth, window, 2)
    errors = {"y": MaxError()}
    if backward:  # first: see the note above run_backward
        dx, dgamma, dbeta = run_backward(fn, [x, gamma, beta], dy_block, depth)
        reference.accumulate(lambda a, b: tiled_planes(dy_block, a, b))
        errors.update(dx=MaxError(), dgamma=MaxError(), dbeta=MaxError())
        errors["dgamma"].add(dgamma, reference.sum_dz_xhat)
        errors["dbeta"].add(dbeta, reference.sum_dz)
        for a, b in _windows(depth, window, g["every"]):
            errors["dx"].add(planes(dx, a, b), reference.input_grad(a, b, tiled_planes(dy_block, a, b)))
        del dx
    y, slabs = run_forward(fn, [x, gamma, beta])
    for a, b in _windows(depth, window, g["every"]):
        errors["y"].add(planes(y, a, b), reference.forward(a, b))
    shapes = {"x": x.shape.as_list(), "y": y.shape.as_list()}
    return {"shapes": shapes, "slabs": slabs, "errors": {k: v.to_dict() for k, v in errors.items()}}


def proof_block(g: dict) -> dict:
    """bigmem's Conv3D(2, 3) -> NormActivation (instance, ReLU), mixed_bfloat16, on (1, depth, hw, hw, 1).

    The conv's output and the block's output are (1, depth, hw, hw, 2), past 2^31. The hand-made
    block: c = TF's bfloat16 conv3d on a window with its halo (the layer's compute dtype), float64
    statistics of c over all windows, normalised windows; backward: float64 sums of dz and dz *
    chat, dc per window from them, then autodiff of the windowed conv with dc (interior planes
    for dx; the float64 sum over disjoint windows for the kernel's gradient).
    """
    import numpy as np
    import tensorflow as tf

    from bigmem.nets.conv import Conv3D
    from bigmem.nets.norm_act import NormActivation

    depth, hw, period, window = g["depth"], g["hw"], g["period"], g["window"]
    x_block = _block((1, period, hw, hw, 1), 1, "bfloat16")
    dy_block = _block((1, period, hw, hw, 2), 3, "bfloat16", low=-1.0, high=1.0)
    kernel = tf.cast(tf.cast(tf.random.stateless_normal((3, 3, 3, 1, 2), [2, 7]) / 27**0.5, tf.bfloat16),
                     tf.float32)  # exactly representable in the bf16 the layer computes in
    conv = Conv3D(2, 3, padding="same", use_bias=False, dtype="mixed_bfloat16")
    norm = NormActivation(dtype="mixed_bfloat16")
    conv.build((1, depth, hw, hw, 1))
    norm.build((1, depth, hw, hw, 2))
    conv.kernel.assign(kernel)
    norm.gamma.assign(GAMMA)
    norm.beta.assign(BETA)
    x = tiled(x_block, depth)

    def fn(x):
        return norm(conv(x))

    def c_planes(a, b):  # the conv's output planes [a, b): TF's bf16 conv on the window, as the layer computes it
        return conv_window(x_block, depth, kernel, 1, a, b, dtype="bfloat16")[0]

    reference = NormReference(c_planes, depth, window, 2)
    errors = {"y": MaxError()}
    variables = [conv.kernel, norm.gamma, norm.beta]
    # first: see the note above run_backward
    dx, dkernel, dgamma, dbeta = run_backward(fn, [x], dy_block, depth, variables)
    reference.accumulate(lambda a, b: tiled_planes(dy_block, a, b))
    errors.update(dx=MaxError(), dkernel=MaxError(), dgamma=MaxError(), dbeta=MaxError())
    errors["dgamma"].add(dgamma, reference.sum_dz_xhat)
    errors["dbeta"].add(dbeta, reference.sum_dz)
    dkernel_want = np.zeros(kernel.shape)
    sampled = set(_windows(depth, window, g["every"]))
    for i0, i1 in _windows(depth, window):
        o0, o1 = _readers(i0, i1, 1, depth)
        dc = reference.input_grad(o0, o1, tiled_planes(dy_block, o0, o1))  # dc on the outputs reading [i0, i1)
        if (i0, i1) in sampled:
            _, lo, dx_want, _ = conv_window(x_block, depth, kernel, 1, o0, o1, dc)
            errors["dx"].add(planes(dx, i0, i1), dx_want[:, i0 - lo:i1 - lo])
        own = dc[:, i0 - o0:i1 - o0]  # the kernel's gradient from outputs [i0, i1) alone: disjoint windows
        dkernel_want += conv_window(x_block, depth, kernel, 1, i0, i1, own)[3].numpy().astype(np.float64)
    errors["dkernel"].add(dkernel, dkernel_want)
    del dx
    y, slabs = run_forward(fn, [x])
    for a, b in _windows(depth, window, g["every"]):
        errors["y"].add(planes(y, a, b), reference.forward(a, b))
    shapes = {"x": x.shape.as_list(), "y": y.shape.as_list()}
    return {"shapes": shapes, "slabs": slabs, "errors": {k: v.to_dict() for k, v in errors.items()}}


# TF's own max_pool3d past 2^32 elements: (1, 2064, 1024^2, 2) = 4.33e9 in bfloat16 (x and dx 8.7 GB
# each; in float32 they would not fit 24 GiB). x tiles a 48-plane block (even, so every 2x2x2
# window sits inside one tile; 2048 planes = 2^32 elements is not a multiple of 48), dy a 43-plane
# one (1032 output planes). --small: the same on (1, 48, 24^2, 2).
PAST_2_32 = {"depth": 2064, "hw": 1024, "x_period": 48, "dy_period": 43, "window": 16, "every": 6}
PAST_2_32_SMALL = {"depth": 48, "hw": 24, "x_period": 8, "dy_period": 3, "window": 4, "every": 1}


def proof_tf_max_pool(g: dict) -> dict:
    """TF's max_pool3d 2x2x2 and its gradient, unpartitioned, in bfloat16 past 2^32 elements (nets/limits.py).

    bfloat16 ties within a window would make the gradient's argmax a choice, so x holds distinct
    values per window: 8 r + p, r a random integer in [0, 16) and p the element's position in
    its window (integers below 128 are exact in bfloat16). Reference: the same ops on windows.
    """
    import tensorflow as tf

    geometry = PAST_2_32 if g["depth"] >= PROOF["depth"] else PAST_2_32_SMALL
    depth, hw, window = geometry["depth"], geometry["hw"], geometry["window"]
    period = geometry["x_period"]
    r = tf.random.stateless_uniform((1, period, hw, hw, 2), [1, 7], 0, 16, dtype=tf.int32)
    d, h, w = (tf.reshape(tf.range(n) % 2, shape) for n, shape in
               ((period, (1, -1, 1, 1, 1)), (hw, (1, 1, -1, 1, 1)), (hw, (1, 1, 1, -1, 1))))
    x_block = tf.cast(8 * r + 4 * d + 2 * h + w, tf.bfloat16)
    dy_block = _block((1, geometry["dy_period"], hw // 2, hw // 2, 2), 3, "bfloat16", low=-1.0, high=1.0)
    x = tiled(x_block, depth)
    return check_pool(lambda x: tf.nn.max_pool3d(x, 2, 2, "VALID"), x, x_block, dy_block, window, geometry["every"])


# op -> (dtype, what, check(geometry) -> result)
PROOF_OPS = {
    # 1 -> 4 channels on half the depth: the output is past 2^31 with the input and dx a quarter of it.
    "conv3d": ("float32", "conv3d_slabs 3x3x3 stride 1, 1 -> 4 ch (output past 2^31)",
               lambda g: proof_conv(g, 1, 1, 4, depth_divisor=2)),
    "conv3d_stride2": ("float32", "conv3d_slabs 3x3x3 stride 2, 2 -> 1 ch (input past 2^31)",
                       lambda g: proof_conv(g, 2, 2, 1)),
    "conv3d_stride2_bf16": ("bfloat16", "the same in bfloat16 (x and dx past 2^31 take 8.6 GB each in fp32)",
                            lambda g: proof_conv(g, 2, 2, 1, dtype="bfloat16")),
    "conv3d_transpose": ("float32", "conv3d_transpose_slabs 2x2x2 stride 2, 2 -> 2 ch (output past 2^31)",
                         proof_conv_transpose),
    "max_pool3d": ("float32", "max_pool3d_slabs 2x2x2 (input past 2^31)", proof_max_pool),
    "max_pool3d_bf16": ("bfloat16", "the same in bfloat16 (x and dx past 2^31 take 8.6 GB each in fp32)",
                        lambda g: proof_max_pool(g, "bfloat16")),
    "tf_max_pool3d_bf16": ("bfloat16", "TF's own max_pool3d 2x2x2, unpartitioned, input past 2^32 (PAST_2_32)",
                           proof_tf_max_pool),
    "norm_relu": ("float32", "norm_activation_slabs instance norm + ReLU, forward (input past 2^31)",
                  lambda g: proof_norm(g, "float32", backward=False)),
    "norm_relu_bf16": ("bfloat16", "norm_activation_slabs instance norm + ReLU, forward + backward",
                       lambda g: proof_norm(g, "bfloat16", backward=True)),
    "block_bf16": ("bfloat16", "Conv3D(1 -> 2) -> NormActivation(instance, ReLU) layers, mixed_bfloat16",
                   proof_block),
}
SHARED_OPS = ("conv3d", "conv3d_deep", "conv3d_stride2", "conv3d_transpose", "max_pool3d", "norm_relu",
              "norm_relu_large")
# The norm's slab path replaces, at every size it runs, the path NormActivation takes for samples
# past FUSED_NORM_MAX_VOXELS (norm_activation_large): past the 2^30-element limit a sample has more
# than 2^23 voxels unless it has more than 128 channels (kits19 first has 256 at its fourth level,
# whose tensor passes 2^30 only from a 1290^3 volume). norm_relu_large compares the two at a size
# past 2^23 voxels, (1, 256^3, 8): 2^27 elements, the slab code in its own 2^22-element slabs.
# conv3d_deep: the stride-1 conv with as many planes in a slab as a production one, where the
# halo's share of the work is the production one: a 512^3 x 32 level holds 64 planes in half a
# 2^30-element slab (slab_target), and (1, 512, 64^2, 32) holds 64 in half of 2^24.
SHARED_OP_SIZES = {"norm_relu_large": ({"edge": 256, "channels": 8}, {"edge": 32, "channels": 8}),
                   "conv3d_deep": ({"edge": 64, "depth": 512, "channels": 32},
                                   {"edge": 16, "depth": 64, "channels": 8})}


def child_proof(request: dict) -> dict:
    """--proof: one partitioned op past 2^31 elements, in its own process (``run_function``), against its reference."""
    from bigmem.memory.procfs import peak_rss_bytes
    from bigmem.sysinfo import tensorflow_description
    from bigmem.tfenv import import_tensorflow

    import_tensorflow()
    from bigmem.nets.slabs import MAX_KERNEL_ELEMENTS, kernel_element_limit

    dtype, _, check = PROOF_OPS[request["op"]]
    started = time.perf_counter()
    result = check(request["geometry"])
    result.update(check_s=time.perf_counter() - started, peak_bytes=peak_rss_bytes())
    if dtype == "bfloat16":
        with kernel_element_limit(MAX_KERNEL_ELEMENTS):
            floor = check(UNPARTITIONED_FLOOR)
        result["unpartitioned_floor"] = {"shapes": floor["shapes"], "slabs": floor["slabs"], "errors": floor["errors"]}
    return {**result, "tensorflow": tensorflow_description()}


# ---- parent side ----------------------------------------------------------------------------------


def run_measurement(child, request: dict, limit: int | None, timeout_s: float, *, heavy: bool,
                    env_extra: dict | None = None) -> dict:
    """``child(request)`` in its own process, kernel limit ``limit``, under the heavy-memory lock if ``heavy``."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env_extra or {})}
    env.pop(LIMIT_VARIABLE, None)
    if limit is not None:
        env[LIMIT_VARIABLE] = str(limit)
    with heavy_turn(heavy, lambda message: print(f"  {message}", flush=True)):
        run = run_function(child, request, env=env, timeout_s=timeout_s, what=f"{request['op']} ({child.__name__})")
    row = {"exit_code": run.returncode, "wall_s": run.wall_s, "child_max_rss_bytes": run.peak_rss_bytes}
    if run.ok:
        return {**row, **run.result}
    return {**row, "error": run.failure(), "stderr_tail": run.stderr_tail(20)}


def _bytes(n: float | None) -> str:
    from bigmem.units import format_bytes

    return "-" if n is None else format_bytes(n)


def run_shared(args, console) -> list[dict]:
    from rich.table import Table

    size = SHARED_SMALL if args.quick else SHARED
    itemsize = 4  # float32
    rows = []
    for op in [o for o in args.ops if o in SHARED_OPS]:
        paths = [("unpartitioned", None), ("partitioned", size["limit"])]
        if op == "norm_relu":  # the slab code with the limit untouched: one slab, the norm's other algorithm
            paths.insert(1, ("slab code, 1 slab", None))
        base = None
        for path, limit in paths:
            shape = SHARED_OP_SIZES.get(op, (size, size))[1 if args.quick else 0]
            request = {"op": op, "path": path, "edge": shape["edge"], "depth": shape.get("depth"),
                       "channels": shape["channels"], "warmup": args.warmup, "repeats": args.repeats}
            row_shape = (1, shape.get("depth") or shape["edge"], shape["edge"], shape["edge"], shape["channels"])
            row = {"op": op, "path": path, "shape": list(row_shape), "limit": limit,
                   "slab_bytes": limit * itemsize if limit else None,
                   **run_measurement(child_shared, request, limit, args.timeout_s, heavy=not args.quick)}
            if "error" not in row:
                times = spread(row["times_s"])
                row.update(**times.as_dict(), spread_pct=times.spread_pct)
                if row["forward_macs"]:
                    row["gflops"] = 3 * 2 * row["forward_macs"] / row["median_s"] / 1e9
                if path == "unpartitioned":
                    base = row
                elif base is not None:
                    row["throughput_ratio"] = base["median_s"] / row["median_s"]
                    if "copy_s" in row:
                        row["copy_bound"] = base["median_s"] / (base["median_s"] + row["copy_s"])
                    row["peak_over_unpartitioned_bytes"] = row["peak_bytes"] - base["peak_bytes"]
                    row["op_peak_over_unpartitioned_bytes"] = row["op_peak_bytes"] - base["op_peak_bytes"]
            rows.append(row)
            console.print(f"{op} {path}: " + (row.get("error") or f"{row['median_s']:.3f} s (spread "
                          f"{row['spread_pct']:.0f}%), {row['slabs']} slab(s), peak {_bytes(row['peak_bytes'])}"),
                          style="dim")
    edge, channels = size["edge"], size["channels"]
    table = Table(title=f"Forward + backward, fp32, (1, {edge}, {edge}, {edge}, {channels}) unless the op says "
                        f"otherwise; partitioned: limit {size['limit']:,} elements ({_bytes(size['limit'] * itemsize)} "
                        f"a slab)")
    for column in ("op", "path", "slabs", "median s", "spread %", "GFLOP/s", "throughput vs unpart.",
                   "copy floor s", "bound", "peak", "op peak", "peak - unpart.", "one slab"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["op"], r["path"], *["-"] * 10, r["error"])
            continue
        ratio = r.get("throughput_ratio")
        name = r["op"] if r["op"] not in SHARED_OP_SIZES else f"{r['op']} {tuple(r['shape'])}"
        table.add_row(name, r["path"], str(r["slabs"]), f"{r['median_s']:.3f}", f"{r['spread_pct']:.0f}",
                      f"{r['gflops']:.0f}" if "gflops" in r else "-", f"{ratio:.2f}" if ratio else "-",
                      f"{r['copy_s']:.3f}" if "copy_s" in r else "-",
                      f"{r['copy_bound']:.2f}" if "copy_bound" in r else "-",
                      _bytes(r["peak_bytes"]), _bytes(r["op_peak_bytes"]),
                      _bytes(r.get("peak_over_unpartitioned_bytes")), _bytes(r["slab_bytes"]))
    console.print(table)
    return rows


def run_proof(args, console) -> list[dict]:
    from rich.table import Table

    geometry = PROOF_SMALL if args.quick else PROOF
    rows = []
    for op in [o for o in args.ops if o in PROOF_OPS]:
        dtype, what, _ = PROOF_OPS[op]
        request = {"op": op, "geometry": geometry}
        row = {"op": op, "dtype": dtype, "what": what,
               **run_measurement(child_proof, request, geometry["limit"], args.proof_timeout_s, heavy=not args.quick,
                                 env_extra={"TF_MKL_ALLOC_MAX_BYTES": str(ALLOCATOR_CAP_BYTES)})}
        if "error" not in row:
            row["max_rel_err"] = max(e["rel_err"] for e in row["errors"].values())
            row["right"] = row["max_rel_err"] <= TOLERANCE[dtype]
        rows.append(row)
        console.print(f"{op}: " + (row.get("error") or f"max rel err {row['max_rel_err']:.2e}, {row['slabs']} slab "
                                   f"writes, peak {_bytes(row['peak_bytes'])}, {row['wall_s']:.0f} s"), style="dim")
    table = Table(title=f"Partitioned ops past 2^31 = {INT32_LIMIT:,} elements against a windowed reference "
                        f"({geometry['window']}-plane windows: planes compared in every {geometry['every']}th "
                        f"and the last; sums over all)")
    floor = "x".join(str(UNPARTITIONED_FLOOR[k]) for k in ("depth", "hw", "hw"))
    for column in ("op", "dtype", "x", "y", "largest tensor (elements)", "output", "windows", "max abs err",
                   "max |ref|", "rel err", f"rel err unpart. {floor}", "right", "slab writes (fwd)", "peak",
                   "wall s"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["op"], r["dtype"], *["-"] * 12, f"{r['wall_s']:.0f}", style="red")
            table.add_row("", "", r["error"])
            continue
        largest = max(_elements(s) for s in r["shapes"].values())
        for i, (name, e) in enumerate(r["errors"].items()):
            head = [r["op"], r["dtype"], str(tuple(r["shapes"]["x"])), str(tuple(r["shapes"]["y"])),
                    f"{largest:.4e}"] if i == 0 else [""] * 5
            tail = [str(r["right"]), str(r["slabs"]), _bytes(r["peak_bytes"]), f"{r['wall_s']:.0f}"] if i == 0 \
                else [""] * 4
            floor_err = r.get("unpartitioned_floor", {}).get("errors", {}).get(name)
            table.add_row(*head, name, str(e["windows"]), f"{e['max_abs_err']:.3e}", f"{e['ref_max_abs']:.3e}",
                          f"{e['rel_err']:.2e}", f"{floor_err['rel_err']:.2e}" if floor_err else "-", *tail)
    console.print(table)
    return rows


def _elements(shape) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=7, repeats_help="timed calls per --shared child", warmup=2,
                          warmup_help="untimed calls first, per --shared child", quick={}, quick_aliases=("--small",),
                          quick_help="tiny sizes with a lowered limit: checks the script (also --small)")
    parser.add_argument("--shared", action="store_true", help="partitioned vs unpartitioned at one size")
    parser.add_argument("--proof", action="store_true", help="every partitioned op past 2^31 elements")
    parser.add_argument("--ops", default=",".join(dict.fromkeys([*SHARED_OPS, *PROOF_OPS])),
                        help="comma-separated subset (default all)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per --shared child")
    parser.add_argument("--proof-timeout-s", type=float, default=1200.0, help="per --proof child")
    args = parser.parse_args(argv)
    args.ops = args.ops.split(",")
    unknown = sorted(set(args.ops) - set(SHARED_OPS) - set(PROOF_OPS))
    if unknown:
        parser.error(f"unknown --ops {','.join(unknown)}; valid: {','.join(dict.fromkeys([*SHARED_OPS, *PROOF_OPS]))}")
    if not (args.shared or args.proof):
        parser.error("nothing to run: give --shared, --proof or both")
    from rich.console import Console

    from bigmem.memory.calibration import machine_cpu_model, machine_isa_class, tensorflow_version
    from bigmem.sysinfo import cpu_description

    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    report = {"command": command_line(__file__, argv), "small": args.quick, "warmup": args.warmup,
              "repeat": args.repeats, "tolerance": TOLERANCE}
    if args.proof:
        report["proof_geometry"] = PROOF_SMALL if args.quick else PROOF
        report["proof_env"] = {"TF_MKL_ALLOC_MAX_BYTES": ALLOCATOR_CAP_BYTES}
        report["proof"] = run_proof(args, console)
    if args.shared:
        report["shared_size"] = SHARED_SMALL if args.quick else SHARED
        report["shared"] = run_shared(args, console)
    children = report.get("shared", []) + report.get("proof", [])
    tensorflow = next((r["tensorflow"] for r in children if "tensorflow" in r), None)
    cpu = cpu_description()
    report["machine"] = {"host": socket.gethostname(), "cpu": machine_cpu_model(), "isa_class": machine_isa_class(),
                         "isa": cpu["isa"], "logical_cpus": cpu["logical_cpus"], "cpus_allowed": cpu["cpus_allowed"],
                         "tensorflow": tensorflow_version(), "tensorflow_runtime": tensorflow}
    for r in children:
        r.pop("tensorflow", None)
    console.print(f"{machine_cpu_model()} ({machine_isa_class()}), TF {tensorflow_version()}, oneDNN "
                  f"{'on' if tensorflow and tensorflow['onednn_enabled'] else 'off'}, "
                  f"threads intra {tensorflow and tensorflow['intra_op_threads']} inter "
                  f"{tensorflow and tensorflow['inter_op_threads']} (0 = TF's default: one per CPU)")
    write_results("slabs-small" if args.quick else "slabs", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
