"""Depth-slab plans: which planes each slab of a partitioned op reads and writes (no TensorFlow import).

An op whose tensors pass the kernel limit (nets/limits.py) runs slab by slab along depth
(nets/slabs.py runs the plans made here). A plan is plain data, one ``Slab`` per piece of the
op's output (forward) or of its input gradient (backward), so the partition can be checked, and
read, without TensorFlow.

Every slab but the last is as long as the limit allows (``plan_slabs``): TensorFlow's pooled
allocator then hands each slab the buffer the one before it freed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from bigmem.nets.limits import max_kernel_elements, max_pool_elements, slab_elements
from bigmem.units import as_shape

# The share of the limit a slab takes in the ops whose backward holds a slab-sized piece beside a
# slab-sized result (max_pool3d_slabs, and conv3d_slabs at stride 1): at full-size slabs they
# peaked 1.55 slabs (pool) and 1.25 slabs (stride-1 conv: +80 MiB with 64 MiB slabs) over the
# unpartitioned op; at half they peak +42 and +23 MiB (bench_slabs --shared, 2026-12-01).
SLAB_FRACTION = 0.5


class SlabTooLargeError(ValueError):
    """One depth plane (with its halo) is already past the kernel limit: depth slabs cannot help."""


@dataclass(frozen=True)
class Slab:
    """One slab of a depth-partitioned op: it reads planes [in_start, in_stop) and writes [out_start, out_stop).

    The op run on the slab alone yields ``pad_before + (out_stop - out_start) + pad_after``
    planes, of which the middle ones are the written ones: forward, the planes either side are
    cropped from its result; backward, the output gradient is zero-padded by as many planes on
    each side. A slab that reads no planes (``in_start == in_stop``) writes zeros: input planes no
    output reads (the planes past a pool's last whole window).

    Args:
        in_start, in_stop: the planes read, halo included.
        out_start, out_stop: the planes written.
        pad_before, pad_after: the slab op's planes before and after the written ones (default 0).

    Example:
        >>> conv_frame(8, 3, 1, 2, 5)  # outputs 2-4 of a 3x3x3 conv from inputs 1-5, one plane of halo each side
        Slab(in_start=1, in_stop=6, out_start=2, out_stop=5, pad_before=1, pad_after=1)
    """

    in_start: int
    in_stop: int
    out_start: int
    out_stop: int
    pad_before: int = 0
    pad_after: int = 0

    @property
    def in_planes(self) -> int:
        """Planes read."""
        return self.in_stop - self.in_start

    @property
    def out_planes(self) -> int:
        """Planes written."""
        return self.out_stop - self.out_start

    @property
    def result_planes(self) -> int:
        """Planes the op yields on this slab alone: the written ones and the padding either side."""
        return self.pad_before + self.out_planes + self.pad_after


@dataclass(frozen=True)
class InputGradSlab:
    """Input planes [out_start, out_stop) of a conv's input gradient, cut from the input gradient of one slab conv.

    ``frame`` is the slab conv: its output gradient is dy's planes [frame.out_start,
    frame.out_stop) padded as the frame says, and its input gradient covers input planes
    [frame.in_start, frame.in_stop). The written planes outside that range are read by no
    output (a 1x1x1 kernel with stride 2 skips planes): their gradient is zero.

    Args:
        out_start, out_stop: the input planes whose gradient is written.
        frame: the slab conv whose input gradient holds them.

    Example:
        >>> InputGradSlab(0, 4, Slab(0, 5, 0, 5)).covered
        (0, 4)
    """

    out_start: int
    out_stop: int
    frame: Slab

    @property
    def out_planes(self) -> int:
        """Planes written."""
        return self.out_stop - self.out_start

    @property
    def covered(self) -> tuple[int, int]:
        """The written planes the frame's input gradient holds, ``(lo, hi)``; empty where ``hi <= lo``."""
        return max(self.out_start, self.frame.in_start), min(self.out_stop, self.frame.in_stop)


@dataclass(frozen=True)
class SlabPlan:
    """The slabs of one op: ``forward`` tiles its output's depth, ``backward`` its input gradient's.

    Args:
        forward: slabs in order; their written planes tile ``[0, output depth)``.
        backward: slabs in order; their written planes tile ``[0, input depth)``.

    Example:
        >>> plan_pool((1, 4, 8, 8, 2), 2, limit=10**6).forward
        (Slab(in_start=0, in_stop=4, out_start=0, out_stop=2, pad_before=0, pad_after=0),)
    """

    forward: tuple[Slab, ...]
    backward: tuple[Slab, ...]


@dataclass(frozen=True)
class ConvPlan:
    """The slabs of a "SAME" conv, and how its weight gradient is summed.

    Args:
        forward: output slabs (each a ``conv_frame``), tiling the output's depth.
        backward: input-gradient slabs, tiling the input's depth.
        tapwise: the weight gradient is summed tap by tap over whole planes (stride 1, odd cubic
            kernel); otherwise as one weight gradient per forward slab.

    Example:
        >>> plan_conv((1, 16, 4, 4, 2), (3, 3, 3, 2, 2), 1, limit=16 * 32).tapwise
        True
    """

    forward: tuple[Slab, ...]
    backward: tuple[InputGradSlab, ...]
    tapwise: bool


def same_padding(length: int, kernel: int, stride: int) -> tuple[int, int]:
    """(output length, padding before) of TF's "SAME" padding along one axis.

    Args:
        length: the input's length in planes.
        kernel: the kernel's length.
        stride: the stride.

    Returns:
        ``(ceil(length / stride), padding before)``; TF puts the odd plane of padding after.

    Example:
        >>> same_padding(35, 3, 2)
        (18, 1)
    """
    out = -(-length // stride)
    total = max((out - 1) * stride + kernel - length, 0)
    return out, total // 2


def conv_frame(depth: int, kernel: int, stride: int, o0: int, o1: int) -> Slab:
    """The slab computing output planes [o0, o1) of a "SAME" conv over ``depth`` input planes.

    A "SAME" conv of the slab's input planes alone yields ``result_planes`` planes, the wanted
    ones after ``pad_before`` of them: the padding TF adds to the slab is zero exactly where the
    whole volume's padding is, and the wanted outputs line up with the slab's stride.

    Args:
        depth: input planes of the whole volume.
        kernel, stride: the conv's kernel length and stride along depth.
        o0, o1: the wanted output planes, ``[o0, o1)``.

    Returns:
        The ``Slab``: the input range to convolve and where the wanted planes sit in its output.

    Raises:
        ValueError: no input range lines up (not reached for ``kernel <= stride + 2``).

    Example:
        >>> conv_frame(35, 3, 2, 0, 4)  # a conv of 9 planes yields 5: the wanted 4, then one cropped
        Slab(in_start=0, in_stop=9, out_start=0, out_stop=4, pad_before=0, pad_after=1)
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
                j0 = offset // stride
                return Slab(a, b, o0, o1, j0, out_len - j0 - (o1 - o0))
    raise ValueError(f"no aligned slab for outputs [{o0}, {o1}) of a kernel-{kernel} stride-{stride} "
                     f"SAME conv over {depth} planes")  # not reached for kernel <= stride + 2


def plan_slabs(length: int, fits: Callable[[int, int], bool], *, what: str,
               limit: int | None = None) -> list[tuple[int, int]]:
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
        limit: the kernel limit, for the error message (default ``max_kernel_elements()``).

    Returns:
        ``[(start, stop), ...]`` covering ``[0, length)`` in order.

    Raises:
        SlabTooLargeError: if even one plane per slab does not fit.

    Example:
        >>> plan_slabs(10, lambda start, stop: stop - start <= 4, what="an op")
        [(0, 4), (4, 8), (8, 10)]
    """
    limit = max_kernel_elements() if limit is None else limit
    if not all(fits(p, p + 1) for p in (0, length // 2, length - 1)):
        raise SlabTooLargeError(f"{what}: a single depth plane with its halo exceeds the kernel limit of "
                                f"{limit} elements; depth slabs cannot bring it under")
    slabs, start = [], 0
    while start < length:
        if not fits(start, start + 1):
            raise SlabTooLargeError(f"{what}: depth plane {start} with its halo exceeds the kernel limit of "
                                    f"{limit} elements")
        stop = start + 1
        while stop < length and fits(start, stop + 1):
            stop += 1
        slabs.append((start, stop))
        start = stop
    return slabs


def slab_target(limit: int, smallest: int) -> int:
    """``SLAB_FRACTION`` of ``limit``, but never below ``smallest`` (the op's least piece) nor above ``limit``.

    A piece past ``limit`` itself is still refused by ``plan_slabs``.

    Args:
        limit: the most elements of one slab tensor.
        smallest: elements of the op's least piece.

    Returns:
        Elements per slab tensor.

    Example:
        >>> slab_target(1000, 100), slab_target(1000, 700), slab_target(1000, 1200)
        (500, 700, 1000)
    """
    return min(limit, max(int(limit * SLAB_FRACTION), smallest))


def _shape(shape: Sequence[int | None]) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


def is_tapwise(kernel_shape: Sequence[int], stride: int | Sequence[int]) -> bool:
    """Whether a conv's weight gradient is summed tap by tap over whole planes: stride 1, an odd depth kernel.

    Args:
        kernel_shape: ``(kd, kh, kw, C_in, C_out)``.
        stride: the stride on every spatial axis, or per axis.

    Returns:
        True for the U-Net's 3x3x3, 1x3x3 and 1x1x1 stride-1 convs.
    """
    return as_shape(stride) == (1, 1, 1) and kernel_shape[0] % 2 == 1


def _input_grad_slab(depth: int, k: int, stride: int, tapwise: bool, i0: int, i1: int) -> InputGradSlab:
    """The slab conv whose input gradient holds input planes [i0, i1) (``plan_conv`` says which)."""
    if tapwise:
        a, b = max(0, i0 - k // 2), min(depth, i1 + k // 2)
        return InputGradSlab(i0, i1, Slab(a, b, a, b))
    out_depth, pad = same_padding(depth, k, stride)
    # The first output that reads plane i0, and one past the last that reads plane i1 - 1. Where
    # none does, any frame will do (the slab's planes get zeros): the next output's, or the last
    # output's at the end of the volume (a 1x1x1 stride-2 conv reads no plane after the last even one).
    o_lo = min(max(0, -(-(i0 + pad - k + 1) // stride)), out_depth - 1)
    o_hi = min(out_depth, (i1 - 1 + pad) // stride + 1)
    return InputGradSlab(i0, i1, conv_frame(depth, k, stride, o_lo, max(o_hi, o_lo + 1)))


def plan_conv(in_shape: Sequence[int], kernel_shape: Sequence[int], stride: int | Sequence[int], *,
              limit: int | None = None) -> ConvPlan:
    """The slabs of ``tf.nn.conv3d(x, kernel, stride, "SAME")`` and of its input gradient.

    Each slab's input planes and its result's planes stay under ``slab_elements`` of the wider plane. The tapwise
    conv (``is_tapwise``) takes ``slab_target``'s share of that: each slab's result (a frame's output planes, an
    input-gradient window) is allocated beside the full-size output, and its least piece is one output plane with
    its k input planes. Strided convs peak well under a slab over the unpartitioned op at full size (+17 MiB with
    64 MiB slabs) and keep it.

    Its input-gradient slab over input planes [i0, i1) is, tapwise, the window [i0 - k//2, i1 + k//2) (clipped to
    the volume) read as both input and output planes: the outputs there are all the ones [i0, i1) feed, so the slab
    conv's input gradient over the window is exact on [i0, i1) and dy is taken as it is (a view, no zero-padded
    copy). Other convs take the frame of every output that reads a plane of [i0, i1), with dy zero-padded to it.

    Args:
        in_shape: ``(batch, D, H, W, C_in)``.
        kernel_shape: ``(kd, kh, kw, C_in, C_out)``; the slabs' halo is the depth kernel's.
        stride: the stride on every spatial axis, or per axis ``(D, H, W)``.
        limit: the kernel element limit (default ``max_kernel_elements()``, the one in force).

    Returns:
        A ``ConvPlan``.

    Raises:
        SlabTooLargeError: one depth plane with its halo is already past the limit.

    Example:
        >>> [s.in_planes for s in plan_conv((1, 16, 4, 4, 2), (3, 3, 3, 2, 2), 1, limit=16 * 32).forward]
        [8, 8, 4]
    """
    batch, depth, height, width, in_channels = _shape(in_shape)
    k, out_channels = int(kernel_shape[0]), int(kernel_shape[-1])
    tapwise = is_tapwise(_shape(kernel_shape), stride)
    stride, stride_h, stride_w = as_shape(stride)  # the slabs are along depth: its stride, from here on
    out_depth, _ = same_padding(depth, k, stride)
    in_plane = height * width * in_channels
    out_plane = -(-height // stride_h) * -(-width // stride_w) * out_channels
    wider = max(in_plane, out_plane)
    elements = slab_elements(wider, limit)
    if tapwise:
        elements = slab_target(elements, k * wider)
    what = f"conv3d on {(batch, depth, height, width, in_channels)}"

    def frame_fits(frame: Slab) -> bool:
        return frame.in_planes * in_plane <= elements and frame.result_planes * out_plane <= elements

    forward = tuple(conv_frame(depth, k, stride, o0, o1) for o0, o1 in plan_slabs(
        out_depth, lambda o0, o1: frame_fits(conv_frame(depth, k, stride, o0, o1)), what=what, limit=limit))

    def input_slab_fits(i0: int, i1: int) -> bool:
        frame = _input_grad_slab(depth, k, stride, tapwise, i0, i1).frame
        if tapwise:
            return frame.in_planes * wider <= elements
        return frame_fits(frame) and (i1 - i0) * in_plane <= elements

    backward = tuple(_input_grad_slab(depth, k, stride, tapwise, i0, i1) for i0, i1 in plan_slabs(
        depth, input_slab_fits, what=f"conv3d input gradient on {(batch, depth, height, width, in_channels)}",
        limit=limit))
    return ConvPlan(forward, backward, tapwise)


def plan_conv_transpose(in_shape: Sequence[int], kernel_shape: Sequence[int], stride: int | Sequence[int], *,
                        limit: int | None = None) -> SlabPlan:
    """The slabs of a transposed conv whose kernel equals its stride, and of its input gradient.

    With kernel == stride no two input planes write the same output plane, so input planes
    [i0, i1) give output planes [k*i0, k*i1) exactly, with no halo, and the gradient splits the
    same way.

    Args:
        in_shape: ``(batch, D, H, W, C_in)``.
        kernel_shape: ``(kd, kh, kw, C_out, C_in)``, equal to the strides.
        stride: the stride on every spatial axis, or per axis ``(D, H, W)``.
        limit: the kernel element limit (default ``max_kernel_elements()``).

    Returns:
        A ``SlabPlan``: forward slabs read input planes and write output planes; backward slabs
        read output-gradient planes and write input-gradient planes.

    Raises:
        SlabTooLargeError: one depth plane is already past the limit.

    Example:
        >>> plan_conv_transpose((1, 3, 2, 2, 1), (2, 2, 2, 1, 1), 2, limit=10**6).forward[0].out_stop
        6
    """
    batch, depth, height, width, in_channels = _shape(in_shape)
    (k, k_h, k_w), out_channels = as_shape(stride), int(kernel_shape[3])
    in_plane, out_plane = height * width * in_channels, k_h * height * k_w * width * out_channels
    piece = max(in_plane, k * out_plane)  # one input plane and the k output planes it writes
    elements = slab_elements(piece, limit)
    ranges = plan_slabs(depth, lambda i0, i1: (i1 - i0) * piece <= elements,
                        what=f"conv3d_transpose on {(batch, depth, height, width, in_channels)}", limit=limit)
    return SlabPlan(tuple(Slab(i0, i1, k * i0, k * i1) for i0, i1 in ranges),
                    tuple(Slab(k * i0, k * i1, i0, i1) for i0, i1 in ranges))


def plan_pool(in_shape: Sequence[int], pool: int | Sequence[int], *, limit: int | None = None) -> SlabPlan:
    """The slabs of ``max_pool3d(x, pool, pool, "VALID")`` and of its input gradient.

    Output planes [o0, o1) read input planes [pool*o0, pool*o1) alone. Whole windows (at least
    ``pool`` planes) in ``slab_target``'s share of the limit: the backward holds each slab's
    gradient piece with its recomputed forward's output and oneDNN workspace. Input planes past
    the last whole window (odd sizes) get a zero gradient, as in TF's own gradient: the last
    backward slab, which reads nothing.

    Args:
        in_shape: ``(batch, D, H, W, C)``.
        pool: the window and stride on every spatial axis, or per axis ``(D, H, W)``.
        limit: the element limit, for pooling too (default: the kernel limit in force for the
            slab size, and pooling's own ``max_pool_elements()``).

    Returns:
        A ``SlabPlan``: forward slabs read input planes and write pooled planes; backward slabs
        read pooled-gradient planes and write input-gradient planes.

    Raises:
        SlabTooLargeError: ``pool`` depth planes are already past the limit.

    Example:
        >>> plan_pool((1, 5, 4, 4, 1), 2, limit=10**6).backward[-1]  # plane 4 is in no window
        Slab(in_start=2, in_stop=2, out_start=4, out_stop=5, pad_before=0, pad_after=0)
    """
    batch, depth, height, width, channels = _shape(in_shape)
    pool = as_shape(pool)[0]  # the slabs are along depth: whole windows of its planes
    out_depth = depth // pool
    in_plane = height * width * channels
    elements = min(slab_elements(in_plane, limit), max_pool_elements() if limit is None else limit)
    target = slab_target(elements, pool * in_plane)
    ranges = plan_slabs(out_depth, lambda o0, o1: pool * (o1 - o0) * in_plane <= target,
                        what=f"max_pool3d on {(batch, depth, height, width, channels)}", limit=limit)
    tail = (Slab(out_depth, out_depth, pool * out_depth, depth),) if depth > pool * out_depth else ()
    return SlabPlan(tuple(Slab(pool * o0, pool * o1, o0, o1) for o0, o1 in ranges),
                    tuple(Slab(o0, o1, pool * o0, pool * o1) for o0, o1 in ranges) + tail)


# ---- ops without a halo, and the narrowest limit every op plans under ----------------------------


def planes_per_slab(in_shape: Sequence[int], *, what: str, target: int | None = None,
                    limit: int | None = None) -> int:
    """Depth planes per slab of an op that reads no halo (the norm, the loss): as many as fit, at least one.

    Each slab reads the planes it writes. They stay under ``slab_elements`` of the plane and,
    given ``target``, under it too, but never below one plane (the norm's float32 temporaries
    take small slabs). Every slab but the last has this many planes, as ``plan_slabs`` makes them.

    Args:
        in_shape: ``(batch, D, H, W, C)``.
        what: the op and shape, for the error message.
        target: the most elements a slab should have (default: as many as the limit allows).
        limit: the kernel element limit (default ``max_kernel_elements()``).

    Returns:
        Planes per slab, from 1 to D.

    Raises:
        SlabTooLargeError: one depth plane is already past the limit.

    Example:
        >>> planes_per_slab((1, 10, 4, 4, 2), what="a norm", target=3 * 32, limit=10**6)
        3
    """
    _, depth, height, width, channels = _shape(in_shape)
    limit = max_kernel_elements() if limit is None else limit
    plane = height * width * channels
    elements = slab_elements(plane, limit)
    if target is not None:
        elements = min(elements, max(plane, target))
    if plane > elements:
        raise SlabTooLargeError(f"{what}: a single depth plane exceeds the kernel limit of {limit} elements; "
                                f"depth slabs cannot bring it under")
    return max(1, min(depth, elements // plane))


def plan_planewise(in_shape: Sequence[int], *, what: str, target: int | None = None,
                   limit: int | None = None) -> tuple[Slab, ...]:
    """The slabs of an op that reads no halo: ``planes_per_slab`` planes each, read and written alike.

    Args:
        in_shape, what, target, limit: as ``planes_per_slab``.

    Returns:
        Slabs in order, ``Slab(d0, d1, d0, d1)``, tiling ``[0, D)``.

    Raises:
        SlabTooLargeError: one depth plane is already past the limit.

    Example:
        >>> [s.out_stop for s in plan_planewise((1, 5, 4, 4, 2), what="the loss", limit=64)]
        [2, 4, 5]
    """
    depth = int(in_shape[1])
    planes = planes_per_slab(in_shape, what=what, target=target, limit=limit)
    return tuple(Slab(d0, min(d0 + planes, depth), d0, min(d0 + planes, depth)) for d0 in range(0, depth, planes))


# The slab ops reading the most planes per plane written: the U-Nets' 3x3x3 convs, (kernel,
# stride). Pooling reads its window, the transposed conv writes k planes per plane, the norm and
# the loss read one plane.
_WIDEST_CONVS = ((3, 1), (3, 2))


@functools.cache
def min_frame_planes() -> int:
    """The fewest depth planes (of the widest plane) a limit must hold for every slab op to plan: 6.

    The most planes any one-plane slab of ``_WIDEST_CONVS`` reads, forward or input gradient,
    from the planner's own frames (interior planes of odd and even depths): a stride-2 3x3x3
    conv's input gradient reads 6 (an input plane is read by two outputs, which read 5 planes,
    and a "SAME" conv of 5 planes pads one before, out of step with the stride); stride 1 reads 3.

    Returns:
        Planes.

    Example:
        >>> min_frame_planes()
        6
    """
    most = 0
    for kernel, stride in _WIDEST_CONVS:
        tapwise = is_tapwise((kernel,) * 3, stride)
        for depth in (16, 17):
            out_depth, _ = same_padding(depth, kernel, stride)
            frames = [conv_frame(depth, kernel, stride, o, o + 1) for o in range(out_depth)]
            frames += [_input_grad_slab(depth, kernel, stride, tapwise, i, i + 1).frame for i in range(depth)]
            most = max(most, *(max(frame.in_planes, frame.result_planes) for frame in frames))
    return most


def plane_runnable(plane_elements: int, limit: int | None = None) -> bool:
    """Whether ops on depth planes of ``plane_elements`` elements run at all, in depth slabs if need be.

    The memory estimates call a shape runnable by this, for its widest plane, so that a shape
    they pass is one the planner plans (``plan_conv`` would otherwise raise ``SlabTooLargeError``).

    Args:
        plane_elements: elements of the widest depth plane, ``H * W * C``.
        limit: the kernel element limit (default ``max_kernel_elements()``).

    Returns:
        True when ``min_frame_planes()`` such planes fit under the limit.

    Example:
        >>> plane_runnable(100, limit=600), plane_runnable(100, limit=599)
        (True, False)
    """
    limit = max_kernel_elements() if limit is None else limit
    return plane_elements * min_frame_planes() <= limit
