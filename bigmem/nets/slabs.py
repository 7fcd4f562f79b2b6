"""Depth slabs: no TensorFlow CPU kernel is handed a tensor past its size limit.

TF 2.21's CPU convolution kernels crash on tensors of more than 2**31 elements, and the weight
gradient is silently wrong just below that (nets/limits.py); a 512^3 volume with 32 channels has
4.3e9 elements. The ops of a
3D U-Net that would see such a tensor run here slab by slab along depth: each slab, with the
halo its kernel needs, stays under the limit; its result is written into the full-size output
in place (``InplaceUpdate`` on an uninitialised buffer, so no concatenated copy), and the
gradient is a custom gradient computed slab by slab too (slicing's own gradient would
materialise a full-size zero tensor per slab).

Slabs run one after another (each waits for the previous slab's write), so at most one slab's
temporaries are alive at once: the peak is the unpartitioned op's plus about one slab. Slices
of whole depth planes of one sample are views (TF's Slice aliases a range of the first axis), so
taking a slab copies nothing. Every slab of an op but the last is as long as the limit allows
(``plan_slabs``), so TensorFlow's pooled allocator hands each slab the buffer the one before it
freed, and the full-size output is allocated only once the first slab's result exists
(``PlaneWriter``), as an unpartitioned kernel allocates its output when it runs.

Shapes are channels-last ``(batch, D, H, W, C)`` with static sizes; every function here works on
any size, so tests lower the limit (``kernel_element_limit``) to run the slab path on small
volumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import tensorflow as tf

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

class SlabTooLargeError(ValueError):
    """One depth plane (with its halo) is already past the kernel limit: depth slabs cannot help."""


# ---- slab geometry -----------------------------------------------------------------------------


def same_padding(length: int, kernel: int, stride: int) -> tuple[int, int]:
    """(output length, padding before) of TF's "SAME" padding along one axis.

    Args:
        length: the input's length in planes.
        kernel: the kernel's length.
        stride: the stride.

    Returns:
        ``(ceil(length / stride), padding before)``; TF puts the odd plane of padding after.
    """
    out = -(-length // stride)
    total = max((out - 1) * stride + kernel - length, 0)
    return out, total // 2


@dataclass(frozen=True)
class ConvFrame:
    """How to compute output planes [o0, o1) of a "SAME" conv from input planes [a, b) alone.

    A "SAME" conv of the input planes [a, b) yields ``out_len`` planes, of which [j0, j0 + o1 - o0)
    are the wanted outputs: the padding TF adds to that slab is zero exactly where the whole
    volume's padding is, and the wanted outputs line up with the slab's stride.
    """

    o0: int
    o1: int
    a: int
    b: int
    j0: int
    out_len: int


def conv_frame(depth: int, kernel: int, stride: int, o0: int, o1: int) -> ConvFrame:
    """The ``ConvFrame`` of output planes [o0, o1) of a "SAME" conv over ``depth`` input planes.

    Args:
        depth: input planes of the whole volume.
        kernel, stride: the conv's kernel length and stride along depth.
        o0, o1: the wanted output planes, ``[o0, o1)``.

    Returns:
        The input range [a, b) to convolve and where the wanted planes sit in its output.

    Raises:
        ValueError: no input range lines up (not reached for ``kernel <= stride + 2``).
    """
    _, pad = same_padding(depth, kernel, stride)
    window_start, window_stop = o0 * stride - pad, (o1 - 1) * stride - pad + kernel
    starts = [0] if window_start <= 0 else range(window_start, max(window_start - stride, 0) - 1, -1)
    stops = [depth] if window_stop >= depth else range(window_stop, min(window_stop + stride, depth) + 1)
    for a in starts:
        for b in stops:
            out_len, slab_pad = same_padding(b - a, kernel, stride)
            offset = window_start - (a - slab_pad)
            if offset % stride == 0 and 0 <= offset // stride and offset // stride + o1 - o0 <= out_len:
                return ConvFrame(o0, o1, a, b, offset // stride, out_len)
    raise ValueError(f"no aligned slab for outputs [{o0}, {o1}) of a kernel-{kernel} stride-{stride} "
                     f"SAME conv over {depth} planes")  # not reached for kernel <= stride + 2


def plan_slabs(length: int, fits: Callable[[int, int], bool], *, what: str) -> list[tuple[int, int]]:
    """The fewest ranges of ``length`` planes for which ``fits(start, stop)`` holds: each as long as fits, in order.

    Every slab but the last is as long as the limit allows, and the last is the rest, so all slabs
    of an op allocate the same temporaries but the last, which are smaller: TensorFlow's CPU
    allocator (a best-fit pool) reuses a freed slab's buffer for the next one. Near-equal slabs
    differ by a plane or by the halo the first slab lacks, and a slab one plane larger than the
    freed one takes fresh memory (a stride-1 conv at 128^3 x 32 in 5 slabs: about one slab more).

    Args:
        length: planes to partition.
        fits: whether the slab ``[start, stop)`` stays under the limit; a range inside one that
            fits must fit too.
        what: the op and shape, for the error message.

    Returns:
        ``[(start, stop), ...]`` covering ``[0, length)`` in order.

    Raises:
        SlabTooLargeError: if even one plane per slab does not fit.
    """
    if not all(fits(p, p + 1) for p in (0, length // 2, length - 1)):
        raise SlabTooLargeError(f"{what}: a single depth plane with its halo exceeds the kernel limit of "
                                f"{max_kernel_elements()} elements; depth slabs cannot bring it under")
    slabs, start = [], 0
    while start < length:
        if not fits(start, start + 1):
            raise SlabTooLargeError(f"{what}: depth plane {start} with its halo exceeds the kernel limit of "
                                    f"{max_kernel_elements()} elements")
        stop = start + 1
        while stop < length and fits(start, stop + 1):
            stop += 1
        slabs.append((start, stop))
        start = stop
    return slabs


# The share of the limit a slab takes in the ops whose backward holds a slab-sized piece beside a
# slab-sized result (max_pool3d_slabs, and conv3d_slabs at stride 1): at full-size slabs they
# peaked 1.55 slabs (pool) and 1.25 slabs (stride-1 conv: +80 MiB with 64 MiB slabs) over the
# unpartitioned op; at half they peak +42 and +23 MiB (bench_slabs --shared, 2026-12-01).
SLAB_FRACTION = 0.5


def slab_target(limit: int, smallest: int) -> int:
    """``SLAB_FRACTION`` of ``limit``, but never below ``smallest`` (the op's least piece) nor above ``limit``.

    A piece past ``limit`` itself is still refused by ``plan_slabs``.

    Example:
        >>> slab_target(1000, 100), slab_target(1000, 700), slab_target(1000, 1200)
        (500, 700, 1000)
    """
    return min(limit, max(int(limit * SLAB_FRACTION), smallest))


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


# ---- convolution -----------------------------------------------------------------------------


def _filter_grad_3d(x, dy, kernel_shape, strides):
    return tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant(kernel_shape, tf.int32),
                                            out_backprop=dy, strides=strides, padding="SAME")


def _conv_frames_into(source: tf.Tensor, kernel: tf.Tensor, frames: Sequence[ConvFrame], out_shape: Sequence[int],
                      strides: list[int]) -> tf.Tensor:
    """A "SAME" conv of ``source`` computed frame by frame, each frame's wanted planes written in place.

    Every slab's input is a view of ``source`` and its wanted output planes a view of the slab's
    result, so per slab only the result (the frame's output planes) is allocated.
    """
    batch, depth = source.shape[0], source.shape[1]
    planes = as_planes(source)
    writer = PlaneWriter(out_shape, source.dtype)
    for sample in range(batch):
        for frame in frames:
            with tf.control_dependencies(writer.after):
                y = tf.nn.conv3d(take_planes(planes, depth, sample, frame.a, frame.b), kernel, strides=strides,
                                 padding="SAME")
            writer.write(sample, frame.o0, crop_planes(y, frame.j0, frame.j0 + frame.o1 - frame.o0))
    return writer.result()


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


@counted('conv3d')
def conv3d_slabs(x: tf.Tensor, kernel: tf.Tensor, stride: int = 1,
                 filter_grad: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None) -> tf.Tensor:
    """``tf.nn.conv3d(x, kernel, stride, "SAME")`` computed in depth slabs, with a slab-wise gradient.

    Stride 1 with an odd cubic kernel (the U-Net's 3x3x3 and 1x1x1 convs) sums the weight gradient
    tap by tap over whole planes (``_tapwise_weight_grad``: views, no zero-padded dy copy, and no
    3-D bf16 weight-gradient kernel, which crashed on an AMX CPU at 512^2 planes). Its input
    gradient is TF's backprop kernel over a window of planes whose outputs are exactly the dy
    planes it needs, a view (``grad_window``); other strides and kernels take it on a zero-padded
    dy slab. (Taking it as the forward conv of dy with the flipped kernel, all views, was dropped:
    TF's bf16 forward conv with one output channel died with SIGFPE on (1, 64, 1024, 1024, 2) on
    that CPU; benchmarks/results/kernels.md.)

    Args:
        x: (batch, D, H, W, C_in), static shape.
        kernel: (k, k, k, C_in, C_out) (any k; equal strides on every axis).
        stride: the stride on every spatial axis.
        filter_grad: ``f(x_slab, dy_slab) -> dkernel`` for one slab's "SAME" conv (e.g. the
            planewise weight gradient), used where the weight gradient is not tapwise (strides
            or kernels other than stride 1 with an odd cubic kernel); default TF's
            Conv3DBackpropFilterV2.

    Returns:
        (batch, ceil(D/stride), ceil(H/stride), ceil(W/stride), C_out), equal to the unpartitioned conv.

    Raises:
        SlabTooLargeError: if one depth plane with its halo is already past the limit.
    """
    batch, depth, height, width, in_channels = x.shape
    k = kernel.shape[0]
    out_depth, _ = same_padding(depth, k, stride)
    out_height, out_width = -(-height // stride), -(-width // stride)
    out_plane = out_height * out_width * kernel.shape[-1]
    in_plane = height * width * in_channels
    strides = [1, stride, stride, stride, 1]
    kernel_shape = [int(s) for s in kernel.shape]
    out_shape = (batch, out_depth, out_height, out_width, kernel_shape[-1])
    filter_grad = filter_grad or (lambda xs, dys: _filter_grad_3d(xs, dys, kernel_shape, strides))
    limit = slab_elements(max(in_plane, out_plane))
    tapwise = stride == 1 and len(set(kernel_shape[:3])) == 1 and k % 2 == 1
    if tapwise:
        # slab_target's share: each slab's result (a frame's output planes, an input-gradient
        # window) is allocated beside the full-size output; the least piece is one output plane
        # with its k input planes. Strided convs peak well under a slab over the unpartitioned op
        # at full size (+17 MiB with 64 MiB slabs) and keep it.
        limit = slab_target(limit, k * max(in_plane, out_plane))

    def frame_fits(frame: ConvFrame) -> bool:
        return (frame.b - frame.a) * in_plane <= limit and frame.out_len * out_plane <= limit

    out_slabs = plan_slabs(out_depth, lambda o0, o1: frame_fits(conv_frame(depth, k, stride, o0, o1)),
                           what=f"conv3d on {tuple(x.shape)}")
    frames = [conv_frame(depth, k, stride, o0, o1) for o0, o1 in out_slabs]

    def input_frame(i0: int, i1: int) -> ConvFrame:
        """The frame of every output that reads an input plane in [i0, i1)."""
        _, pad = same_padding(depth, k, stride)
        o_lo = max(0, -(-(i0 + pad - k + 1) // stride))
        o_hi = min(out_depth, (i1 - 1 + pad) // stride + 1)
        return conv_frame(depth, k, stride, o_lo, max(o_hi, o_lo + 1))

    halo = k // 2  # stride 1, odd cubic kernel: input plane i reads output planes [i - halo, i + halo]

    def grad_window(i0: int, i1: int) -> tuple[int, int]:
        """Stride 1: the input (and output) planes [a, b) whose "SAME" input gradient covers [i0, i1).

        The outputs [i0 - halo, i1 + halo) are all the input planes [i0, i1) read; a "SAME" conv
        over input planes [a, b) = those same planes has exactly them as outputs, so dy is a view
        (no zero-padded copy) and [i0, i1) of its input gradient are complete.
        """
        return max(0, i0 - halo), min(depth, i1 + halo)

    def input_slab_fits(i0: int, i1: int) -> bool:
        if tapwise:
            a, b = grad_window(i0, i1)
            return (b - a) * max(in_plane, out_plane) <= limit
        return frame_fits(input_frame(i0, i1)) and (i1 - i0) * in_plane <= limit

    in_slabs = plan_slabs(depth, input_slab_fits, what=f"conv3d input gradient on {tuple(x.shape)}")

    def dy_for(dy_planes, sample, frame: ConvFrame):
        """dy of the frame's outputs, zero-padded to the slab conv's out_len planes."""
        dy = take_planes(dy_planes, out_depth, sample, frame.o0, frame.o1)
        return _pad_depth(dy, frame.j0, frame.out_len - frame.j0 - (frame.o1 - frame.o0))

    def gradients(x, dy, kernel):
        x_planes, dy_planes = as_planes(x), as_planes(dy)
        dx = PlaneWriter(x.shape, x.dtype)
        for sample in range(batch):
            for i0, i1 in in_slabs:
                if tapwise:
                    a, b = grad_window(i0, i1)
                    with tf.control_dependencies(dx.after):
                        dx_window = tf.raw_ops.Conv3DBackpropInputV2(
                            input_sizes=tf.constant([1, b - a, height, width, in_channels], tf.int32),
                            filter=kernel, out_backprop=take_planes(dy_planes, out_depth, sample, a, b),
                            strides=strides, padding="SAME")
                    dx.write(sample, i0, crop_planes(dx_window, i0 - a, i1 - a))
                    continue
                frame = input_frame(i0, i1)
                with tf.control_dependencies(dx.after):
                    dx_frame = tf.raw_ops.Conv3DBackpropInputV2(
                        input_sizes=tf.constant([1, frame.b - frame.a, height, width, in_channels], tf.int32),
                        filter=kernel, out_backprop=dy_for(dy_planes, sample, frame), strides=strides,
                        padding="SAME")
                # Planes of [i0, i1) outside the frame are read by no output (a 1x1x1 kernel
                # with stride 2 skips planes): their gradient is 0.
                lo, hi = max(i0, frame.a), min(i1, frame.b)
                if hi > lo:
                    piece = _pad_depth(crop_planes(dx_frame, lo - frame.a, hi - frame.a), lo - i0, i1 - hi)
                else:
                    piece = tf.zeros((1, i1 - i0, height, width, in_channels), x.dtype)
                dx.write(sample, i0, piece)
        dx = dx.result()
        # Summed in float32: a bfloat16 running sum rounds at every slab, and over many slabs
        # drifts well past one unpartitioned call's error (benchmarks/results/kernels.md).
        dkernel = tf.zeros(kernel_shape, tf.float32)
        for sample in range(batch):
            for frame in frames:
                with tf.control_dependencies([dx, dkernel]):  # one slab at a time, after the input gradient
                    if tapwise:
                        piece = _tapwise_weight_grad(x_planes, dy_planes, depth, sample, frame.o0, frame.o1,
                                                     kernel_shape)
                    else:
                        piece = tf.cast(filter_grad(take_planes(x_planes, depth, sample, frame.a, frame.b),
                                                    dy_for(dy_planes, sample, frame)), tf.float32)
                    dkernel = dkernel + piece
        return dx, tf.cast(dkernel, kernel.dtype)

    @tf.custom_gradient
    def conv(x, kernel):
        y = _conv_frames_into(x, kernel, frames, out_shape, strides)

        def grad(dy):
            return gradients(x, dy, kernel)

        return y, grad

    return conv(x, kernel)


@counted('conv3d_transpose')
def conv3d_transpose_slabs(x: tf.Tensor, kernel: tf.Tensor, stride: int,
                           filter_grad: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None) -> tf.Tensor:
    """A transposed conv whose kernel equals its stride (``Conv3DTranspose(k, strides=k)``), in depth slabs.

    With kernel == stride no two input planes write the same output plane, so input planes
    [i0, i1) give output planes [k*i0, k*i1) exactly, and both gradients split the same way.

    Args:
        x: (batch, D, H, W, C_in), static shape.
        kernel: (k, k, k, C_out, C_in), Keras's and TF's layout for transposed convs.
        stride: equal to k.
        filter_grad: ``f(dy_slab, x_slab) -> dkernel`` for one slab (e.g. the 2-D
            ``transposed_weight_grad``); default TF's Conv3DBackpropFilterV2.

    Returns:
        (batch, k*D, k*H, k*W, C_out), without bias.

    Raises:
        ValueError: the kernel is not ``stride`` on every axis.
        SlabTooLargeError: if one depth plane is already past the limit.
    """
    batch, depth, height, width, in_channels = x.shape
    k = kernel.shape[0]
    if tuple(kernel.shape[:3]) != (stride,) * 3:
        raise ValueError(f"conv3d_transpose_slabs needs kernel == stride, got kernel {tuple(kernel.shape[:3])}, "
                         f"stride {stride}")
    out_channels = kernel.shape[3]
    in_plane, out_plane = height * width * in_channels, k * height * k * width * out_channels
    limit = slab_elements(max(in_plane, k * out_plane))
    slabs = plan_slabs(depth, lambda i0, i1: (i1 - i0) * max(in_plane, k * out_plane) <= limit,
                       what=f"conv3d_transpose on {tuple(x.shape)}")
    strides = [1, k, k, k, 1]
    out_shape = (batch, k * depth, k * height, k * width, out_channels)
    filter_grad = filter_grad or (lambda dys, xs: _filter_grad_3d(dys, xs, kernel.shape.as_list(), strides))

    @tf.custom_gradient
    def up(x, kernel):
        x_planes = as_planes(x)
        writer = PlaneWriter(out_shape, x.dtype)
        for sample in range(batch):
            for i0, i1 in slabs:
                with tf.control_dependencies(writer.after):
                    y = tf.raw_ops.Conv3DBackpropInputV2(
                        input_sizes=tf.constant([1, k * (i1 - i0), *out_shape[2:]], tf.int32), filter=kernel,
                        out_backprop=take_planes(x_planes, depth, sample, i0, i1), strides=strides, padding="SAME")
                writer.write(sample, k * i0, y)

        def grad(dy):
            dy_planes = as_planes(dy)
            dx = PlaneWriter(x.shape, x.dtype)
            dkernel = tf.zeros(kernel.shape, tf.float32)  # float32, as in conv3d_slabs
            for sample in range(batch):
                for i0, i1 in slabs:
                    with tf.control_dependencies(dx.after + [dkernel]):
                        dy_slab = take_planes(dy_planes, k * depth, sample, k * i0, k * i1)
                        dx.write(sample, i0, tf.nn.conv3d(dy_slab, kernel, strides=strides, padding="SAME"))
                    with tf.control_dependencies(dx.after):
                        dkernel = dkernel + tf.cast(
                            filter_grad(dy_slab, take_planes(x_planes, depth, sample, i0, i1)), tf.float32)
            return dx.result(), tf.cast(dkernel, kernel.dtype)

        return writer.result(), grad

    return up(x, kernel)


@counted('max_pool3d')
def max_pool3d_slabs(x: tf.Tensor, pool: int) -> tf.Tensor:
    """``tf.nn.max_pool3d(x, pool, pool, "VALID")`` in depth slabs, with a slab-wise gradient.

    Output planes [o0, o1) read input planes [pool*o0, pool*o1) alone; input planes past the last
    whole window (odd sizes) get a zero gradient, as in TF's own gradient.

    Args:
        x: ``(batch, D, H, W, C)``, static shape.
        pool: the window and stride on every spatial axis.

    Returns:
        ``(batch, D // pool, H // pool, W // pool, C)``.

    Raises:
        SlabTooLargeError: if ``pool`` depth planes are already past the limit.
    """
    batch, depth, height, width, channels = x.shape
    out_depth = depth // pool
    in_plane = height * width * channels
    limit = min(slab_elements(in_plane), max_pool_elements())
    # Whole windows (at least `pool` planes) in slab_target's share of the limit: the backward holds
    # each slab's gradient piece with its recomputed forward's output and oneDNN workspace.
    target = slab_target(limit, pool * in_plane)
    slabs = plan_slabs(out_depth, lambda o0, o1: pool * (o1 - o0) * in_plane <= target,
                       what=f"max_pool3d on {tuple(x.shape)}")
    window = [1, pool, pool, pool, 1]

    @tf.custom_gradient
    def pool_op(x):
        x_planes = as_planes(x)
        writer = PlaneWriter((batch, out_depth, height // pool, width // pool, channels), x.dtype)
        for sample in range(batch):
            for o0, o1 in slabs:
                with tf.control_dependencies(writer.after):
                    y = tf.nn.max_pool3d(take_planes(x_planes, depth, sample, pool * o0, pool * o1), window, window,
                                         "VALID")
                writer.write(sample, o0, y)
        y = writer.result()

        def grad(dy):
            # TF's own gradient of each slab's pool (the forward recomputed under a tape): a bare
            # MaxPool3DGrad cannot use oneDNN's forward workspace and is far slower
            # (benchmarks/results/kernels.md).
            dy_planes = as_planes(dy)
            dx = PlaneWriter(x.shape, x.dtype)
            for sample in range(batch):
                for o0, o1 in slabs:
                    with tf.control_dependencies(dx.after):
                        x_slab = take_planes(x_planes, depth, sample, pool * o0, pool * o1)
                        with tf.GradientTape() as tape:
                            tape.watch(x_slab)
                            y_slab = tf.nn.max_pool3d(x_slab, window, window, "VALID")
                        piece = tape.gradient(y_slab, x_slab,
                                              output_gradients=take_planes(dy_planes, out_depth, sample, o0, o1))
                    dx.write(sample, pool * o0, piece)
                if depth > pool * out_depth:
                    dx.write(sample, pool * out_depth,
                             tf.zeros((1, depth - pool * out_depth, height, width, channels), x.dtype))
            return dx.result()

        return y, grad

    return pool_op(x)
