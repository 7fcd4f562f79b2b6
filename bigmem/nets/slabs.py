"""Depth slabs: no TensorFlow CPU kernel is handed a tensor past its size limit.

TF 2.21's CPU convolution kernels crash on tensors of more than 2**31 elements, and the weight
gradient is silently wrong just below that (nets/limits.py); a 512^3 volume with 32 channels has
4.3e9 elements. The ops of a
3D U-Net that would see such a tensor run here slab by slab along depth: each slab, with the
halo its kernel needs, stays under the limit; its result is written into the full-size output
in place (``InplaceUpdate`` on an uninitialised buffer, so no concatenated copy), and the
gradient is a custom gradient computed slab by slab too (slicing's own gradient would
materialise a full-size zero tensor per slab).

Which planes each slab reads and writes is planned without TensorFlow (nets/slabplan.py); every
kernel here runs its plan through one loop (``write_slabs``). Slabs run one after another (each
waits for the previous slab's write), so at most one slab's temporaries are alive at once: the
peak is the unpartitioned op's plus about one slab. Slices of whole depth planes of one sample
are views (TF's Slice aliases a range of the first axis), so taking a slab copies nothing. Every
slab of an op but the last is as long as the limit allows (``plan_slabs``), so TensorFlow's
pooled allocator hands each slab the buffer the one before it freed, and the full-size output is
allocated only once the first slab's result exists (``PlaneWriter``), as an unpartitioned kernel
allocates its output when it runs.

Shapes are channels-last ``(batch, D, H, W, C)`` with static sizes; every function here works on
any size, so tests lower the limit (``kernel_element_limit``) to run the slab path on small
volumes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import tensorflow as tf

from bigmem.units import as_shape

from bigmem.nets.limits import (  # noqa: F401  (re-exported: the slab API in one place)
    LIMIT_ENVIRONMENT_VARIABLE,
    MAX_KERNEL_ELEMENTS,
    MAX_SLAB_ELEMENTS,
    counted,
    exceeds_limit,
    kernel_element_limit,
    max_kernel_elements,
    max_pool_elements,
    slab_elements,
)
from bigmem.nets.slabplan import (  # noqa: F401  (re-exported, as above)
    SLAB_FRACTION,
    ConvPlan,
    InputGradSlab,
    Slab,
    SlabPlan,
    SlabTooLargeError,
    conv_frame,
    plan_conv,
    plan_conv_transpose,
    plan_pool,
    plan_slabs,
    same_padding,
    slab_target,
)


# ---- reading and writing rows of depth planes ---------------------------------------------------


def as_planes(t: tf.Tensor) -> tf.Tensor:
    """(B, D, H, W, C) -> (B*D, H, W, C): sample b's plane d is row b*D + d (no copy)."""
    shape = t.shape
    return tf.reshape(t, (shape[0] * shape[1], *shape[2:]))


def take_planes(planes: tf.Tensor, depth: int, sample: int, start: int, stop: int) -> tf.Tensor:
    """Planes [start, stop) of one sample from ``as_planes`` rows, as (1, stop - start, H, W, C) (a view)."""
    rows = tf.slice(planes, [sample * depth + start, 0, 0, 0], [stop - start, -1, -1, -1])
    return tf.expand_dims(rows, 0)


class PlaneWriter:
    """Fills an uninitialised (B, D, H, W, C) tensor plane range by plane range, in place, in order.

    Each write waits for the previous one (``after`` gives the dependency to put on the next
    slab's work), so slabs never run side by side. The full-size buffer is allocated only once
    the first slab's values exist, as a TF kernel allocates its output when it runs: an
    uninitialised buffer has no inputs, and TensorFlow's executor would otherwise allocate it as
    soon as the step starts, beside tensors that are freed before an unpartitioned op's output
    exists (a stride-1 conv's input gradient at 128^3 x 32: +256 MiB, one whole tensor).

    Args:
        shape: the full tensor's static shape ``(B, D, H, W, C)``.
        dtype: its dtype.

    Example:
        >>> writer = PlaneWriter((1, 4, 8, 8, 2), tf.float32)
        >>> writer.write(0, 0, tf.ones((1, 4, 8, 8, 2)))  # then writer.result(): (1, 4, 8, 8, 2)
    """

    def __init__(self, shape: Sequence[int], dtype):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.depth = self.shape[1]
        self.rows: tf.Tensor | None = None
        self.written = 0

    @property
    def after(self) -> list[tf.Tensor]:
        """Control dependencies that make the next slab's work wait for the last write."""
        return [] if self.rows is None else [self.rows]

    def write(self, sample: int, start: int, values: tf.Tensor) -> None:
        """Planes [start, start + n) of ``sample`` := values (1, n, H, W, C)."""
        count = values.shape[1]
        first = sample * self.depth + start
        if self.rows is None:
            with tf.control_dependencies([values]):
                self.rows = tf.raw_ops.Empty(shape=(self.shape[0] * self.depth, *self.shape[2:]), dtype=self.dtype,
                                             init=False)
        self.rows = tf.raw_ops.InplaceUpdate(x=self.rows, i=tf.range(first, first + count),
                                             v=tf.reshape(values, (count, *self.shape[2:])))
        self.written += count

    def result(self) -> tf.Tensor:
        """The filled tensor, ``shape``.

        Raises:
            RuntimeError: not every plane was written (a bug in the caller).
        """
        if self.written != self.shape[0] * self.depth:  # a bug in a caller, never a user error
            raise RuntimeError(f"PlaneWriter: {self.written} of {self.shape[0] * self.depth} planes written")
        return tf.reshape(self.rows, self.shape)


def crop_planes(t: tf.Tensor, start: int, stop: int) -> tf.Tensor:
    """Planes [start, stop) of a (1, L, H, W, C) tensor, as a view (a range of the first axis)."""
    rows = tf.reshape(t, t.shape[1:])
    if (start, stop) == (0, t.shape[1]):
        return t
    return tf.expand_dims(tf.slice(rows, [start, 0, 0, 0], [stop - start, -1, -1, -1]), 0)


def _pad_depth(t: tf.Tensor, before: int, after: int) -> tf.Tensor:
    if not (before or after):
        return t
    return tf.pad(t, [[0, 0], [before, after], [0, 0], [0, 0], [0, 0]])


def write_slabs(shape: Sequence[int], dtype, slabs: Sequence[Slab | InputGradSlab],
                compute: Callable[[int, Slab | InputGradSlab], tf.Tensor]) -> tf.Tensor:
    """A (B, D, H, W, C) tensor written slab by slab, in place: ``compute(sample, slab)`` fills its planes.

    Every sample's slabs run in order, each after the previous write (``PlaneWriter.after``), so
    one slab's temporaries are alive at a time.

    Args:
        shape: the full tensor's static shape ``(B, D, H, W, C)``.
        dtype: its dtype.
        slabs: the plan; their written planes ``[out_start, out_stop)`` tile ``[0, D)``.
        compute: ``f(sample, slab) -> (1, slab.out_planes, H, W, C)`` values.

    Returns:
        The filled tensor, ``shape``.

    Example:
        >>> planes = as_planes(x)  # x: (1, 4, 8, 8, 2)
        >>> y = write_slabs(x.shape, x.dtype, [Slab(0, 2, 0, 2), Slab(2, 4, 2, 4)],
        ...                 lambda sample, s: take_planes(planes, 4, sample, s.in_start, s.in_stop))  # a copy of x
    """
    writer = PlaneWriter(shape, dtype)
    for sample in range(int(shape[0])):
        for slab in slabs:
            with tf.control_dependencies(writer.after):
                values = compute(sample, slab)
            writer.write(sample, slab.out_start, values)
    return writer.result()


def sum_slabs(shape: Sequence[int], batch: int, slabs: Sequence[Slab], compute: Callable[[int, Slab], tf.Tensor],
              after: Sequence[tf.Tensor]) -> tf.Tensor:
    """The float32 sum of ``compute(sample, slab)`` over every sample's slabs, one at a time, after ``after``.

    Summed in float32: a bfloat16 running sum rounds at every slab, and over many slabs drifts
    well past one unpartitioned call's error (benchmarks/results/kernels.md).

    Args:
        shape: each term's shape (a kernel's).
        batch: samples.
        slabs: the plan.
        compute: ``f(sample, slab) -> term``, any float dtype.
        after: tensors every term waits for (the input gradient, so the terms' temporaries are
            never alive beside its slabs').

    Returns:
        float32 ``shape``.
    """
    total = tf.zeros(shape, tf.float32)
    for sample in range(batch):
        for slab in slabs:
            with tf.control_dependencies([*after, total]):  # one slab at a time
                total = total + tf.cast(compute(sample, slab), tf.float32)
    return total


# ---- convolution -----------------------------------------------------------------------------


def _filter_grad_3d(x, dy, kernel_shape, strides):
    return tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant(kernel_shape, tf.int32),
                                            out_backprop=dy, strides=strides, padding="SAME")


def _conv_slab(planes: tf.Tensor, kernel: tf.Tensor, depth: int, strides: list[int], sample: int,
               frame: Slab) -> tf.Tensor:
    """One frame of a "SAME" conv: its input planes are a view, its wanted output planes a view of the result."""
    y = tf.nn.conv3d(take_planes(planes, depth, sample, frame.in_start, frame.in_stop), kernel, strides=strides,
                     padding="SAME")
    return crop_planes(y, frame.pad_before, frame.pad_before + frame.out_planes)


def _frame_dy(dy_planes: tf.Tensor, out_depth: int, sample: int, frame: Slab) -> tf.Tensor:
    """dy of the frame's outputs, zero-padded to the slab conv's output planes (a view where it needs none)."""
    dy = take_planes(dy_planes, out_depth, sample, frame.out_start, frame.out_stop)
    return _pad_depth(dy, frame.pad_before, frame.pad_after)


def _conv_input_grad_slab(dy_planes: tf.Tensor, kernel: tf.Tensor, out_depth: int, x_shape: Sequence[int],
                          strides: list[int], sample: int, slab: InputGradSlab) -> tf.Tensor:
    """The input gradient of the slab's input planes: TF's backprop kernel over its frame, cut to them."""
    frame, (_, _, height, width, in_channels) = slab.frame, x_shape
    dx_frame = tf.raw_ops.Conv3DBackpropInputV2(
        input_sizes=tf.constant([1, frame.in_planes, height, width, in_channels], tf.int32),
        filter=kernel, out_backprop=_frame_dy(dy_planes, out_depth, sample, frame), strides=strides,
        padding="SAME")
    lo, hi = slab.covered
    if hi <= lo:  # no output reads these planes (a 1x1x1 kernel with stride 2 skips planes)
        return tf.zeros((1, slab.out_planes, height, width, in_channels), dx_frame.dtype)
    return _pad_depth(crop_planes(dx_frame, lo - frame.in_start, hi - frame.in_start), lo - slab.out_start,
                      slab.out_stop - hi)


def _tapwise_weight_grad(x_planes: tf.Tensor, dy_planes: tf.Tensor, depth: int, sample: int, o0: int, o1: int,
                         kernel_shape: Sequence[int]) -> tf.Tensor:
    """The weight gradient of output planes [o0, o1) of a stride-1 "SAME" conv with an odd cubic kernel.

    Depth tap ``kd`` pairs output plane ``o`` with input plane ``o + kd - k // 2``, so
    ``dW[kd] = conv2d_weight_grad(x planes [o0 + kd - k//2, o1 + kd - k//2), dy planes [o0, o1))``,
    the depth planes as the batch ("SAME" in height and width, as the 3-D conv pads them; taps
    past the volume's first or last plane read its zero padding and are left out). Both stacks
    are views of whole planes: unlike a 3-D weight gradient over the slab, no zero-padded copy of
    dy is made.

    Returns:
        float32 ``(k, k, k, C_in, C_out)``.
    """
    k = kernel_shape[0]
    taps = []
    for kd in range(k):
        shift = kd - k // 2
        lo, hi = max(o0, -shift), min(o1, depth - shift)  # outputs whose tap reads a plane of the volume
        if hi <= lo:
            taps.append(tf.zeros(kernel_shape[1:], tf.float32))
            continue
        rows_x = tf.slice(x_planes, [sample * depth + lo + shift, 0, 0, 0], [hi - lo, -1, -1, -1])
        rows_dy = tf.slice(dy_planes, [sample * depth + lo, 0, 0, 0], [hi - lo, -1, -1, -1])
        taps.append(tf.cast(tf.raw_ops.Conv2DBackpropFilter(
            input=rows_x, filter_sizes=tf.constant(kernel_shape[1:], tf.int32), out_backprop=rows_dy,
            strides=[1, 1, 1, 1], padding="SAME"), tf.float32))
    return tf.stack(taps)


def _tapwise_weight_grads(x: tf.Tensor, dy: tf.Tensor, kernel_shape: Sequence[int], frames: Sequence[Slab],
                          after: Sequence[tf.Tensor]) -> tf.Tensor:
    """The weight gradient of a stride-1 conv with an odd cubic kernel: each frame's, tap by tap, summed (float32)."""
    x_planes, dy_planes, depth = as_planes(x), as_planes(dy), x.shape[1]
    return sum_slabs(kernel_shape, x.shape[0], frames,
                     lambda sample, frame: _tapwise_weight_grad(x_planes, dy_planes, depth, sample, frame.out_start,
                                                                frame.out_stop, kernel_shape), after)


def _whole_weight_grads(x: tf.Tensor, dy: tf.Tensor, kernel_shape: Sequence[int], frames: Sequence[Slab],
                        after: Sequence[tf.Tensor], *,
                        filter_grad: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """The weight gradient as ``filter_grad`` of each frame's input planes and zero-padded dy, summed (float32)."""
    x_planes, dy_planes = as_planes(x), as_planes(dy)
    return sum_slabs(kernel_shape, x.shape[0], frames, lambda sample, frame: filter_grad(
        take_planes(x_planes, x.shape[1], sample, frame.in_start, frame.in_stop),
        _frame_dy(dy_planes, dy.shape[1], sample, frame)), after)


@counted('conv3d')
def conv3d_slabs(x: tf.Tensor, kernel: tf.Tensor, stride: int | Sequence[int] = 1,
                 filter_grad: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None) -> tf.Tensor:
    """``tf.nn.conv3d(x, kernel, stride, "SAME")`` computed in depth slabs, with a slab-wise gradient.

    Stride 1 with an odd cubic kernel (the U-Net's 3x3x3 and 1x1x1 convs) sums the weight gradient
    tap by tap over whole planes (``_tapwise_weight_grad``: views, no zero-padded dy copy, and no
    3-D bf16 weight-gradient kernel, which crashed on an AMX CPU at 512^2 planes). Its input
    gradient is TF's backprop kernel over a window of planes whose outputs are exactly the dy
    planes it needs, a view (``plan_conv``); other strides and kernels take it on a zero-padded
    dy slab. (Taking it as the forward conv of dy with the flipped kernel, all views, was dropped:
    TF's bf16 forward conv with one output channel died with SIGFPE on (1, 64, 1024, 1024, 2) on
    that CPU; benchmarks/results/kernels.md.)

    Args:
        x: (batch, D, H, W, C_in), static shape.
        kernel: (kd, kh, kw, C_in, C_out) (any sizes).
        stride: the stride on every spatial axis, or per axis ``(D, H, W)``.
        filter_grad: ``f(x_slab, dy_slab) -> dkernel`` for one slab's "SAME" conv (e.g. the
            planewise weight gradient), used where the weight gradient is not tapwise (strides
            or kernels other than stride 1 with an odd cubic kernel); default TF's
            Conv3DBackpropFilterV2.

    Returns:
        (batch, ceil(D/sd), ceil(H/sh), ceil(W/sw), C_out) for strides (sd, sh, sw), equal to the unpartitioned
        conv.

    Raises:
        SlabTooLargeError: if one depth plane with its halo is already past the limit.
    """
    batch, depth, height, width, _ = x.shape
    kernel_shape = [int(s) for s in kernel.shape]
    plan = plan_conv(x.shape, kernel_shape, stride)
    stride_d, stride_h, stride_w = as_shape(stride)
    strides = [1, stride_d, stride_h, stride_w, 1]
    out_shape = (batch, -(-depth // stride_d), -(-height // stride_h), -(-width // stride_w), kernel_shape[-1])
    weight_grads = _tapwise_weight_grads if plan.tapwise else functools.partial(
        _whole_weight_grads, filter_grad=filter_grad or functools.partial(
            _filter_grad_3d, kernel_shape=kernel_shape, strides=strides))

    @tf.custom_gradient
    def conv(x, kernel):
        y = write_slabs(out_shape, x.dtype, plan.forward,
                        functools.partial(_conv_slab, as_planes(x), kernel, depth, strides))

        def grad(dy):
            dx = write_slabs(x.shape, x.dtype, plan.backward, functools.partial(
                _conv_input_grad_slab, as_planes(dy), kernel, out_shape[1], x.shape, strides))
            dkernel = weight_grads(x, dy, kernel_shape, plan.forward, [dx])
            return dx, tf.cast(dkernel, kernel.dtype)

        return y, grad

    return conv(x, kernel)


def _transposed_slab(x_planes: tf.Tensor, kernel: tf.Tensor, depth: int, out_shape: Sequence[int],
                     strides: list[int], sample: int, slab: Slab) -> tf.Tensor:
    """The output planes of one slab of input planes: TF's transposed conv (the conv's input gradient)."""
    return tf.raw_ops.Conv3DBackpropInputV2(
        input_sizes=tf.constant([1, slab.out_planes, *out_shape[2:]], tf.int32), filter=kernel,
        out_backprop=take_planes(x_planes, depth, sample, slab.in_start, slab.in_stop), strides=strides,
        padding="SAME")


@counted('conv3d_transpose')
def conv3d_transpose_slabs(x: tf.Tensor, kernel: tf.Tensor, stride: int | Sequence[int],
                           filter_grad: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None) -> tf.Tensor:
    """A transposed conv whose kernel equals its stride (``Conv3DTranspose(k, strides=k)``), in depth slabs.

    With kernel == stride no two input planes write the same output plane, so input planes
    [i0, i1) give output planes [k*i0, k*i1) exactly, and both gradients split the same way.

    Args:
        x: (batch, D, H, W, C_in), static shape.
        kernel: (kd, kh, kw, C_out, C_in), Keras's and TF's layout for transposed convs.
        stride: equal to the kernel: one for every axis, or per axis ``(D, H, W)``.
        filter_grad: ``f(dy_slab, x_slab) -> dkernel`` for one slab (e.g. the 2-D
            ``transposed_weight_grad``); default TF's Conv3DBackpropFilterV2.

    Returns:
        (batch, kd*D, kh*H, kw*W, C_out), without bias.

    Raises:
        ValueError: the kernel is not the stride.
        SlabTooLargeError: if one depth plane is already past the limit.
    """
    batch, depth, height, width, _ = x.shape
    k, k_h, k_w = as_shape(stride)
    if tuple(kernel.shape[:3]) != (k, k_h, k_w):
        raise ValueError(f"conv3d_transpose_slabs needs kernel == stride, got kernel {tuple(kernel.shape[:3])}, "
                         f"stride {stride}")
    plan = plan_conv_transpose(x.shape, kernel.shape, stride)
    strides = [1, k, k_h, k_w, 1]
    out_shape = (batch, k * depth, k_h * height, k_w * width, kernel.shape[3])
    filter_grad = filter_grad or functools.partial(_filter_grad_3d, kernel_shape=kernel.shape.as_list(),
                                                   strides=strides)

    @tf.custom_gradient
    def up(x, kernel):
        x_planes = as_planes(x)
        y = write_slabs(out_shape, x.dtype, plan.forward,
                        functools.partial(_transposed_slab, x_planes, kernel, depth, out_shape, strides))

        def grad(dy):
            dy_planes = as_planes(dy)
            dx = write_slabs(x.shape, x.dtype, plan.backward, lambda sample, slab: tf.nn.conv3d(
                take_planes(dy_planes, k * depth, sample, slab.in_start, slab.in_stop), kernel, strides=strides,
                padding="SAME"))
            dkernel = sum_slabs(kernel.shape, batch, plan.backward, lambda sample, slab: filter_grad(
                take_planes(dy_planes, k * depth, sample, slab.in_start, slab.in_stop),
                take_planes(x_planes, depth, sample, slab.out_start, slab.out_stop)), [dx])
            return dx, tf.cast(dkernel, kernel.dtype)

        return y, grad

    return up(x, kernel)


# ---- pooling ---------------------------------------------------------------------------------


def _pool_grad_slab(x_planes: tf.Tensor, dy_planes: tf.Tensor, x_shape: Sequence[int], out_depth: int,
                    window: list[int], sample: int, slab: Slab) -> tf.Tensor:
    """The input gradient of one slab of whole windows: TF's own gradient of the slab's pool.

    The forward is recomputed under a tape: a bare MaxPool3DGrad cannot use oneDNN's forward
    workspace and is far slower (benchmarks/results/kernels.md). A slab that reads no pooled
    planes (those past the last whole window) gets zeros, as in TF's own gradient.
    """
    if slab.in_planes == 0:
        return tf.zeros((1, slab.out_planes, *x_shape[2:]), x_planes.dtype)
    x_slab = take_planes(x_planes, x_shape[1], sample, slab.out_start, slab.out_stop)
    with tf.GradientTape() as tape:
        tape.watch(x_slab)
        y_slab = tf.nn.max_pool3d(x_slab, window, window, "VALID")
    return tape.gradient(y_slab, x_slab,
                         output_gradients=take_planes(dy_planes, out_depth, sample, slab.in_start, slab.in_stop))


@counted('max_pool3d')
def max_pool3d_slabs(x: tf.Tensor, pool: int | Sequence[int]) -> tf.Tensor:
    """``tf.nn.max_pool3d(x, pool, pool, "VALID")`` in depth slabs, with a slab-wise gradient.

    Output planes [o0, o1) read input planes [pool*o0, pool*o1) alone; input planes past the last
    whole window (odd sizes) get a zero gradient, as in TF's own gradient.

    Args:
        x: ``(batch, D, H, W, C)``, static shape.
        pool: the window and stride on every spatial axis, or per axis ``(D, H, W)``.

    Returns:
        ``(batch, D // pd, H // ph, W // pw, C)`` for pool ``(pd, ph, pw)``.

    Raises:
        SlabTooLargeError: if ``pool`` depth planes are already past the limit.
    """
    batch, depth, height, width, channels = x.shape
    plan = plan_pool(x.shape, pool)
    pool_d, pool_h, pool_w = as_shape(pool)
    out_shape = (batch, depth // pool_d, height // pool_h, width // pool_w, channels)
    window = [1, pool_d, pool_h, pool_w, 1]

    @tf.custom_gradient
    def pool_op(x):
        x_planes = as_planes(x)
        y = write_slabs(out_shape, x.dtype, plan.forward, lambda sample, slab: tf.nn.max_pool3d(
            take_planes(x_planes, depth, sample, slab.in_start, slab.in_stop), window, window, "VALID"))

        def grad(dy):
            return write_slabs(x.shape, x.dtype, plan.backward, functools.partial(
                _pool_grad_slab, x_planes, as_planes(dy), x.shape, out_shape[1], window))

        return y, grad

    return pool_op(x)
