"""Slab plans tile their op exactly, with the right halos, without TensorFlow.

A 1-D "SAME" convolution in NumPy stands in for TF's along depth (the only axis slabs cut): run
slab by slab as a plan says, it must give the whole-volume conv, its input gradient and its
weight gradient.
"""

import subprocess
import sys

import numpy as np
import pytest

from bigmem.nets.slabplan import (
    InputGradSlab,
    Slab,
    SlabTooLargeError,
    conv_frame,
    is_tapwise,
    min_frame_planes,
    plan_conv,
    plan_conv_transpose,
    plan_planewise,
    plan_pool,
    plan_slabs,
    plane_runnable,
    planes_per_slab,
    same_padding,
    slab_target,
)

DEPTHS = [1, 2, 5, 8, 33, 34, 35]
KERNELS = [(3, 1), (3, 2), (1, 1), (1, 2), (2, 2)]  # (kernel, stride)
# The fewest planes a slab of each needs (test_the_fewest_planes_a_conv_needs), or the whole depth.
FEWEST_PLANES = {(3, 1): 3, (3, 2): 6, (1, 1): 1, (1, 2): 1, (2, 2): 2}


def test_the_planner_imports_no_tensorflow():
    code = "import sys, bigmem.nets.slabplan; print(sorted(m for m in sys.modules if m.startswith('tensorflow')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _tiles(ranges, length):
    """Whether the (start, stop) ranges cover [0, length) in order, each plane once."""
    ranges = list(ranges)
    return bool(ranges) and ranges[0][0] == 0 and ranges[-1][1] == length and all(
        start < stop for start, stop in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _written(slabs):
    return [(s.out_start, s.out_stop) for s in slabs]


# ---- a 1-D "SAME" conv along depth, as TF computes it -----------------------------------------


def _conv(x, w, stride):
    out, pad = same_padding(len(x), len(w), stride)
    return np.array([sum(w[t] * x[o * stride - pad + t] for t in range(len(w)) if 0 <= o * stride - pad + t < len(x))
                     for o in range(out)])


def _input_grad(dy, w, stride, length):
    out, pad = same_padding(length, len(w), stride)
    assert len(dy) == out
    dx = np.zeros(length)
    for o in range(out):
        for t in range(len(w)):
            if 0 <= o * stride - pad + t < length:
                dx[o * stride - pad + t] += w[t] * dy[o]
    return dx


def _weight_grad(x, dy, k, stride):
    out, pad = same_padding(len(x), k, stride)
    assert len(dy) == out
    return np.array([sum(dy[o] * x[o * stride - pad + t] for o in range(out) if 0 <= o * stride - pad + t < len(x))
                     for t in range(k)])


def _padded(values, slab):
    return np.concatenate([np.zeros(slab.pad_before), values, np.zeros(slab.pad_after)])


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kernel,stride", KERNELS)
@pytest.mark.parametrize("planes", [1, 3, 6, 7, 9, 1000])
def test_conv_plan_reproduces_the_whole_conv_and_its_gradients(depth, kernel, stride, planes):
    """Planes per slab from one (where the op needs no more) to one slab for all."""
    rng = np.random.default_rng(depth * 100 + kernel * 10 + stride)
    x, w = rng.normal(size=depth), rng.normal(size=kernel)
    out_depth, _ = same_padding(depth, kernel, stride)
    dy = rng.normal(size=out_depth)
    if planes < min(depth, FEWEST_PLANES[kernel, stride]):
        with pytest.raises(SlabTooLargeError):
            plan_conv((1, depth, 1, 1, 1), (kernel,) * 3 + (1, 1), stride, limit=planes)
        return
    plan = plan_conv((1, depth, 1, 1, 1), (kernel,) * 3 + (1, 1), stride, limit=planes)

    assert _tiles(_written(plan.forward), out_depth)
    assert _tiles(_written(plan.backward), depth)
    y = np.concatenate([_conv(x[s.in_start:s.in_stop], w, stride)[s.pad_before:s.pad_before + s.out_planes]
                        for s in plan.forward])
    np.testing.assert_allclose(y, _conv(x, w, stride), atol=1e-12)

    pieces = []
    for slab in plan.backward:
        frame = slab.frame
        dx_frame = _input_grad(_padded(dy[frame.out_start:frame.out_stop], frame), w, stride, frame.in_planes)
        piece, (lo, hi) = np.zeros(slab.out_planes), slab.covered
        piece[max(lo, slab.out_start) - slab.out_start:max(hi, lo) - slab.out_start] = \
            dx_frame[lo - frame.in_start:hi - frame.in_start]
        pieces.append(piece)
    np.testing.assert_allclose(np.concatenate(pieces), _input_grad(dy, w, stride, depth), atol=1e-12)

    if plan.tapwise:  # tap t pairs output o with input o + t - k//2, over the frame's outputs
        dw = [sum(dy[o] * x[o + t - kernel // 2] for s in plan.forward for o in range(s.out_start, s.out_stop)
                  if 0 <= o + t - kernel // 2 < depth) for t in range(kernel)]
    else:
        dw = sum(_weight_grad(x[s.in_start:s.in_stop], _padded(dy[s.out_start:s.out_stop], s), kernel, stride)
                 for s in plan.forward)
    np.testing.assert_allclose(dw, _weight_grad(x, dy, kernel, stride), atol=1e-12)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kernel,stride", KERNELS)
def test_conv_frames_reproduce_same_padding(depth, kernel, stride):
    """Every output plane of every slab frame reads exactly the planes the whole-volume conv reads."""
    out_depth, pad = same_padding(depth, kernel, stride)
    for o0 in range(out_depth):
        for o1 in range(o0 + 1, min(out_depth, o0 + 4) + 1):
            frame = conv_frame(depth, kernel, stride, o0, o1)
            assert 0 <= frame.in_start < frame.in_stop <= depth
            slab_out, slab_pad = same_padding(frame.in_planes, kernel, stride)
            assert frame.result_planes == slab_out
            assert min(frame.pad_before, frame.pad_after) >= 0
            for j, o in enumerate(range(o0, o1)):
                first_read = frame.in_start - slab_pad + (frame.pad_before + j) * stride
                assert first_read == o * stride - pad
                for t in range(kernel):
                    read = first_read + t
                    # A plane the slab pads with zeros must be padding in the whole volume too.
                    assert (frame.in_start <= read < frame.in_stop) == (0 <= read < depth)


def test_stride1_halos_are_one_plane_inside_and_none_at_the_volume_ends():
    # 35 planes of 2 elements, a 3x3x3 kernel; limit 28: half is 14 elements, 7 planes a slab.
    plan = plan_conv((1, 35, 1, 1, 2), (3, 3, 3, 2, 2), 1, limit=28)
    first, *inner, last = plan.forward
    assert first == Slab(0, 7, 0, 6, 0, 1)  # TF pads before plane 0, as the whole conv does
    assert last.in_stop == 35
    assert last.out_stop == 35
    assert last.pad_after == 0
    assert inner
    assert all((s.in_start, s.in_stop, s.pad_before, s.pad_after) == (s.out_start - 1, s.out_stop + 1, 1, 1)
                         for s in inner)
    assert [s.in_planes for s in plan.forward] == [7, 7, 7, 7, 7, 7, 5]  # all full but the last
    # Input gradient: windows of the written planes and one more each side, clipped to the volume.
    assert plan.backward[0] == InputGradSlab(0, 6, Slab(0, 7, 0, 7))  # read as inputs and as outputs
    assert plan.backward[-1].frame.in_stop == 35
    assert all(g.frame == Slab(g.out_start - 1, g.out_stop + 1, g.out_start - 1, g.out_stop + 1)
               for g in plan.backward[1:-1])


def test_stride2_on_an_odd_depth():
    # 35 planes -> 18 outputs, one plane of "SAME" padding before; 9 input planes a slab.
    plan = plan_conv((1, 35, 2, 2, 1), (3, 3, 3, 1, 1), 2, limit=36)
    assert not plan.tapwise
    assert plan.forward[0] == Slab(0, 9, 0, 4, 0, 1)  # the 9-plane conv yields 5: the 4 wanted, then one cropped
    assert plan.forward[1] == Slab(7, 15, 4, 7, 0, 1)  # output 4 reads planes 7-9
    assert _tiles(_written(plan.forward), 18)
    assert _tiles(_written(plan.backward), 35)
    assert all(s.in_planes <= 9 for s in plan.forward)
    assert all(g.out_planes <= 9 and g.frame.in_planes <= 9 for g in plan.backward)


@pytest.mark.parametrize("shape,kernel,stride", [((1, 33, 6, 5, 2), 3, 1), ((2, 35, 5, 7, 3), 3, 2),
                                                 ((1, 19, 4, 6, 2), 1, 2), ((1, 16, 4, 4, 2), 2, 2)])
def test_one_slab_when_the_op_is_small(shape, kernel, stride):
    depth, out_depth = shape[1], same_padding(shape[1], kernel, stride)[0]
    plan = plan_conv(shape, (kernel,) * 3 + (shape[-1], 4), stride, limit=10**9)
    assert plan.forward == (Slab(0, depth, 0, out_depth, 0, plan.forward[0].pad_after),)
    assert len(plan.backward) == 1
    assert _written(plan.backward) == [(0, depth)]
    assert plan_pool(shape, 2, limit=10**9).forward == (Slab(0, 2 * (depth // 2), 0, depth // 2),)
    assert plan_conv_transpose(shape, (2, 2, 2, 4, shape[-1]), 2, limit=10**9).forward == (
        Slab(0, depth, 0, 2 * depth),)


@pytest.mark.parametrize("shape,kernel,stride,out_channels", [((1, 33, 6, 5, 2), 3, 1, 3), ((1, 34, 6, 6, 2), 3, 2, 3),
                                                              ((2, 17, 4, 4, 3), 3, 1, 8), ((1, 19, 4, 6, 2), 1, 2, 3)])
def test_conv_slabs_stay_under_the_limit(shape, kernel, stride, out_channels):
    in_plane = shape[2] * shape[3] * shape[4]
    out_plane = -(-shape[2] // stride) * -(-shape[3] // stride) * out_channels
    limit = 7 * max(in_plane, out_plane)
    plan = plan_conv(shape, (kernel,) * 3 + (shape[-1], out_channels), stride, limit=limit)
    elements = slab_target(limit, kernel * max(in_plane, out_plane)) if plan.tapwise else limit
    assert all(s.in_planes * in_plane <= elements and s.result_planes * out_plane <= elements for s in plan.forward)
    assert all(g.frame.in_planes * in_plane <= elements for g in plan.backward)
    assert len(plan.forward) > 1
    for s in plan.forward[:-1]:  # as long as fits: one more output plane would not
        longer = conv_frame(shape[1], kernel, stride, s.out_start, s.out_stop + 1)
        assert longer.in_planes * in_plane > elements or longer.result_planes * out_plane > elements


def test_the_fewest_planes_a_conv_needs():
    """Stride 2 with a 3x3x3 kernel: 6 planes (an input plane is read by two outputs, which read 5
    planes, and a "SAME" conv of 5 planes pads one before, out of step with the stride); stride 1: 3."""
    plane = 4 * 4 * 2
    for depth in (20, 35):
        plan_conv((1, depth, 4, 4, 2), (3, 3, 3, 2, 2), 2, limit=6 * plane)
        with pytest.raises(SlabTooLargeError, match="conv3d input gradient on"):
            plan_conv((1, depth, 4, 4, 2), (3, 3, 3, 2, 2), 2, limit=6 * plane - 1)
    plan_conv((1, 20, 4, 4, 2), (3, 3, 3, 2, 2), 1, limit=3 * plane)
    with pytest.raises(SlabTooLargeError, match="conv3d on"):
        plan_conv((1, 20, 4, 4, 2), (3, 3, 3, 2, 2), 1, limit=3 * plane - 1)


def test_a_plane_past_the_limit_is_refused_with_its_numbers():
    with pytest.raises(SlabTooLargeError, match=r"conv3d on \(1, 4, 8, 8, 2\): a single depth plane with its halo "
                                                r"exceeds the kernel limit of 127 elements"):
        plan_conv((1, 4, 8, 8, 2), (3, 3, 3, 2, 2), 1, limit=127)
    with pytest.raises(SlabTooLargeError, match=r"depth plane 2 with its halo"):
        plan_slabs(6, lambda start, stop: stop - start <= 2 and start != 2, what="an op")  # no slab from plane 2 fits


@pytest.mark.parametrize("kernel_shape,stride,tapwise", [((3, 3, 3, 2, 2), 1, True), ((1, 1, 1, 2, 2), 1, True),
                                                         ((3, 3, 3, 2, 2), 2, False), ((2, 2, 2, 2, 2), 1, False),
                                                         ((1, 3, 3, 2, 2), 1, True), ((3, 1, 3, 2, 2), 1, True),
                                                         ((1, 3, 3, 2, 2), (1, 2, 2), False),
                                                         ((2, 3, 3, 2, 2), (1, 1, 1), False)])
def test_the_weight_gradient_is_tapwise_for_stride1_odd_depth_kernels(kernel_shape, stride, tapwise):
    assert is_tapwise(kernel_shape, stride) is tapwise


@pytest.mark.parametrize("depth", [8, 9, 35])
def test_pool_plan_tiles_both_ways_and_zeroes_the_planes_past_the_last_window(depth):
    plane = 4 * 4 * 2
    plan = plan_pool((1, depth, 4, 4, 2), 2, limit=8 * plane)  # half: 4 input planes, 2 windows a slab
    assert all(s == Slab(2 * s.out_start, 2 * s.out_stop, s.out_start, s.out_stop) for s in plan.forward)
    assert [s.out_planes for s in plan.forward][:-1] == [2] * (len(plan.forward) - 1)
    assert _tiles(_written(plan.forward), depth // 2)
    assert _tiles(_written(plan.backward), depth)
    tail = plan.backward[-1]
    assert (tail.in_planes == 0) == (depth % 2 == 1)
    if depth % 2:
        assert (tail.out_start, tail.out_stop) == (depth - 1, depth)


def test_pool_slabs_take_half_the_limit_but_never_less_than_a_window():
    plane = 4 * 4 * 2
    assert len(plan_pool((1, 16, 4, 4, 2), 2, limit=8 * plane).forward) == 4
    assert len(plan_pool((1, 16, 4, 4, 2), 2, limit=3 * plane).forward) == 8
    with pytest.raises(SlabTooLargeError, match="max_pool3d on"):
        plan_pool((1, 16, 4, 4, 2), 2, limit=plane)


@pytest.mark.parametrize("depth", [5, 9])
def test_transposed_plan_writes_k_planes_per_input_plane(depth):
    plane_in, plane_out = 2 * 2 * 3, 4 * 4 * 2  # (1, D, 2, 2, 3) -> (1, 2D, 4, 4, 2)
    plan = plan_conv_transpose((1, depth, 2, 2, 3), (2, 2, 2, 2, 3), 2, limit=2 * 2 * plane_out)
    assert max(plane_in, 2 * plane_out) == 64
    assert [s.in_planes for s in plan.forward][:-1] == [2] * (
        len(plan.forward) - 1)
    assert all((s.out_start, s.out_stop) == (2 * s.in_start, 2 * s.in_stop) for s in plan.forward)
    assert _tiles(_written(plan.forward), 2 * depth)
    assert _tiles(_written(plan.backward), depth)
    assert [(s.in_start, s.in_stop) for s in plan.backward] == _written(plan.forward)


def test_the_fewest_planes_every_op_needs_is_the_strided_convs():
    """plane_runnable is the planner's verdict: it passes a plane exactly where every slab op plans."""
    assert min_frame_planes() == max(FEWEST_PLANES.values()) == 6
    plane = 4 * 4 * 2
    for limit in (6 * plane, 6 * plane - 1, int(5.5 * plane), 5 * plane):
        try:
            for depth in (20, 35):
                plan_conv((1, depth, 4, 4, 2), (3, 3, 3, 2, 2), 2, limit=limit)
                plan_conv((1, depth, 4, 4, 2), (3, 3, 3, 2, 2), 1, limit=limit)
                plan_pool((1, depth, 4, 4, 2), 2, limit=limit)
                plan_conv_transpose((1, depth, 2, 2, 2), (2, 2, 2, 2, 2), 2, limit=limit)  # writes 4x4x2 planes
            planned = True
        except SlabTooLargeError:
            planned = False
        assert plane_runnable(plane, limit=limit) is planned is (limit >= 6 * plane), limit


@pytest.mark.parametrize("depth", [1, 5, 9, 35])
def test_planewise_slabs_read_what_they_write_and_tile_the_depth(depth):
    plane = 4 * 4 * 2
    slabs = plan_planewise((2, depth, 4, 4, 2), what="the loss", limit=3 * plane)
    assert all(s == Slab(s.out_start, s.out_stop, s.out_start, s.out_stop) for s in slabs)
    assert _tiles(_written(slabs), depth)
    assert [s.out_planes for s in slabs][:-1] == [3] * (len(slabs) - 1)
    assert slabs[-1].out_planes <= 3
    # the same slabs as plan_slabs makes for a limit on whole planes
    assert _written(slabs) == plan_slabs(depth, lambda d0, d1: (d1 - d0) * plane <= 3 * plane, what="the loss")


def test_planes_per_slab_takes_the_target_but_never_less_than_a_plane():
    plane = 4 * 4 * 2
    assert planes_per_slab((1, 16, 4, 4, 2), what="a norm", target=5 * plane, limit=10**6) == 5
    assert planes_per_slab((1, 16, 4, 4, 2), what="a norm", target=plane // 2, limit=10**6) == 1
    assert planes_per_slab((1, 16, 4, 4, 2), what="a norm", target=10**6, limit=3 * plane) == 3  # the limit rules
    assert planes_per_slab((1, 4, 4, 4, 2), what="a norm", limit=10**6) == 4  # never past the depth
    with pytest.raises(SlabTooLargeError, match=r"a norm: a single depth plane exceeds the kernel limit of 31 "
                                                r"elements"):
        planes_per_slab((1, 16, 4, 4, 2), what="a norm", target=10**6, limit=plane - 1)
