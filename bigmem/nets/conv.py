"""Conv3D whose weight gradient is computed plane by plane where that is faster.

oneDNN's 3-D weight-gradient kernels are its weakest without AMX: the bfloat16 one has no
brgemm version and slows down as the volume grows, and the stride-2 ones (fp32 and bf16) run at
a fraction of the forward pass's rate. For a 3x3x3 "same" convolution the weight gradient
splits along depth into three 2-D weight gradients, one per depth tap ``kd``, over stacks of
depth planes as the batch:

- stride 1: ``dW[kd] = sum_d conv2d_weight_grad(x[d + kd - 1], dy[d])``; for kd = 0 the output
  planes 1..D-1 read input planes 0..D-2, for kd = 2 the planes 0..D-2 read 1..D-1 (the zero
  padding contributes nothing). Each stack is a range of whole planes, taken without a copy.
- stride 2 (even sizes, which TF pads by one plane after): ``dW[kd] = sum_d
  conv2d_weight_grad_stride2(x[2d + kd], dy[d])``: kd = 0 reads the even planes, kd = 1 the odd
  ones, kd = 2 the even planes from the second on against the output planes but the last. The
  even and odd plane stacks are copies, made one after the other (half the input each).

Which is faster depends on the ISA class oneDNN runs at, the precision, the stride and the
channel count; nets/choices.py holds that decision per ISA class (timings:
benchmarks/results/kernels.md). Forward and input gradient are TF's own kernels either way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import keras
import tensorflow as tf

from bigmem.nets.choices import planewise_others, takes_planewise
from bigmem.nets.slabs import conv3d_slabs, conv3d_transpose_slabs, exceeds_limit, same_padding


@dataclass(frozen=True)
class ConvCall:
    """One convolution a trace ran, as ``observe_convolutions`` records it.

    Attributes:
        kind: "conv" (``Conv3D``) or "transpose" (``Conv3DTranspose``).
        input_shape: ``(batch, D, H, W, C_in)``.
        kernel: the kernel's shape as Keras keeps it: ``(k, k, k, C_in, C_out)`` for a conv,
            ``(k, k, k, C_out, C_in)`` for a transposed conv.
        stride: on every axis, or per axis ``(D, H, W)`` where they differ.
        precision: "fp32" or "bf16".
        path: the weight gradient's path: "3d" (TF's own), "planewise", "pointwise", "2d"
            (a transposed conv's), or "slabs" (past the kernel limit).
    """

    kind: str
    input_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: int | tuple[int, int, int]
    precision: str
    path: str


_observers: list[list[ConvCall]] = []


@contextlib.contextmanager
def observe_convolutions():
    """Record every ``Conv3D``/``Conv3DTranspose`` call of static shape made inside: the network's
    convolutions at their own shapes, and the path each took (the tuning pass times them; tests
    check a tuning's choice is the one the layers take).

    Example:
        >>> with observe_convolutions() as calls:
        ...     model(keras.ops.zeros((1, 32, 32, 32, 1)))
        >>> calls[0].path
        '3d'
    """
    calls: list[ConvCall] = []
    _observers.append(calls)
    try:
        yield calls
    finally:
        _observers.remove(calls)


def _observe(kind: str, inputs, kernel_shape, strides, path: str) -> None:
    shape = tuple(inputs.shape)
    if _observers and None not in shape:
        strides = tuple(int(s) for s in strides)
        stride = strides[0] if len(set(strides)) == 1 else strides
        call = ConvCall(kind, shape, tuple(int(k) for k in kernel_shape), stride, _precision(inputs), path)
        for calls in _observers:
            calls.append(call)



def _precision(inputs: tf.Tensor) -> str:
    """nets/choices.py's name for the precision a layer computes in: "bf16" or "fp32"."""
    return "bf16" if inputs.dtype == tf.bfloat16 else "fp32"


def _plane_stack(t: tf.Tensor) -> tf.Tensor:
    """(B, D, H, W, C) -> (B*D, H, W, C)."""
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))


def planewise_weight_grad(x: tf.Tensor, dy: tf.Tensor, kernel_shape, stride: int = 1) -> tf.Tensor:
    """The weight gradient of a 3x3x3 "same" conv3d (stride 1 or 2), as three batched conv2d gradients.

    Every slice taken is a range of whole planes of one sample, which TF's Slice returns without
    copying.

    Args:
        x: the conv's input ``(batch, D, H, W, C_in)``, static batch and depth; with
            ``stride=2``, D, H and W must be even.
        dy: the gradient of its output ``(batch, D / stride, H / stride, W / stride, C_out)``,
            same dtype as ``x``.
        kernel_shape: ``(3, 3, 3, C_in, C_out)``.
        stride: 1 or 2 on every spatial axis (default 1).

    Returns:
        ``dkernel`` of shape ``(3, 3, 3, C_in, C_out)`` in ``x``'s dtype, equal (to float
        rounding) to ``Conv3DBackpropFilterV2``'s.
    """
    batch, depth = x.shape[0], x.shape[1]
    out_depth = depth // stride
    filter_sizes = tf.constant([3, 3, kernel_shape[3], kernel_shape[4]])
    dy_planes = _plane_stack(dy)

    def planes(stack, sample, start, stop):  # every stack holds out_depth planes per sample
        return tf.slice(stack, tf.stack([sample * out_depth + start, 0, 0, 0]), tf.stack([stop - start, -1, -1, -1]))

    def grad_2d(source, x_start, x_stop, dy_start, dy_stop):
        return tf.add_n([tf.raw_ops.Conv2DBackpropFilter(
            input=planes(source, sample, x_start, x_stop), filter_sizes=filter_sizes,
            out_backprop=planes(dy_planes, sample, dy_start, dy_stop), strides=[1, stride, stride, 1], padding="SAME")
            for sample in range(batch)])

    if stride == 1:
        x_planes = _plane_stack(x)
        # Depth tap kd pairs output plane d with input plane d + kd - 1.
        return tf.stack([grad_2d(x_planes, 0, depth - 1, 1, depth), grad_2d(x_planes, 0, depth, 0, depth),
                         grad_2d(x_planes, 1, depth, 0, depth - 1)])
    # Depth tap kd pairs output plane d with input plane 2d + kd (plane D is padding): kd = 0 and 2
    # read the even planes, kd = 1 the odd ones. The odd copy is made once the even one is used
    # up, so only half the input is ever copied at once.
    pairs = tf.reshape(x, tf.concat([[batch, out_depth, 2], tf.shape(x)[2:]], axis=0))
    even = _plane_stack(pairs[:, :, 0])
    tap0, tap2 = grad_2d(even, 0, out_depth, 0, out_depth), grad_2d(even, 1, out_depth, 0, out_depth - 1)
    with tf.control_dependencies([tap0, tap2]):
        odd = _plane_stack(pairs[:, :, 1])
    return tf.stack([tap0, grad_2d(odd, 0, out_depth, 0, out_depth), tap2])


def pointwise_weight_grad(x: tf.Tensor, dy: tf.Tensor) -> tf.Tensor:
    """The weight gradient of a 1x1x1 conv3d (stride 1), as one 1x1 conv2d weight gradient over all planes.

    Args:
        x: the conv's input ``(batch, D, H, W, C_in)``.
        dy: the gradient of its output ``(batch, D, H, W, C_out)``, same dtype as ``x``.

    Returns:
        ``dkernel`` of shape ``(1, 1, 1, C_in, C_out)`` in ``x``'s dtype.
    """
    grad = tf.raw_ops.Conv2DBackpropFilter(
        input=_plane_stack(x), filter_sizes=tf.constant([1, 1, x.shape[-1], dy.shape[-1]]),
        out_backprop=_plane_stack(dy), strides=[1, 1, 1, 1], padding="SAME")
    return tf.expand_dims(grad, 0)


# The transposed conv's weight gradient copies the output planes of one depth tap at a time (every
# k-th plane); in this many depth chunks per sample, so a copy is 1/(k * chunks) of dy.
TRANSPOSED_GRAD_CHUNKS = 8


def transposed_weight_grad(dy: tf.Tensor, x: tf.Tensor, stride: int) -> tf.Tensor:
    """The kernel gradient of a transposed conv whose kernel equals its stride, as 2-D weight gradients.

    Output plane ``k*i + a`` comes from input plane ``i`` through depth tap ``a`` alone, so
    ``dW[a] = sum_i conv2d_weight_grad_stride_k(dy[k*i + a], x[i])``: per depth chunk of the
    input, the tap's output planes (a strided copy) against the chunk's input planes (a view).

    Args:
        dy: the gradient of the transposed conv's output ``(batch, k*D, k*H, k*W, C_out)``.
        x: its input ``(batch, D, H, W, C_in)``, static shape, ``dy``'s dtype.
        stride: ``k``, the kernel size and stride on every axis.

    Returns:
        ``dkernel`` ``(k, k, k, C_out, C_in)`` in float32 (summed over chunks in float32).
    """
    batch, depth = x.shape[0], x.shape[1]
    k = stride
    out_channels, in_channels = dy.shape[-1], x.shape[-1]
    filter_sizes = tf.constant([k, k, out_channels, in_channels])
    x_planes, dy_planes = _plane_stack(x), _plane_stack(dy)
    step = -(-depth // TRANSPOSED_GRAD_CHUNKS)
    taps = [tf.zeros((k, k, out_channels, in_channels), tf.float32) for _ in range(k)]
    for sample in range(batch):
        for i0 in range(0, depth, step):
            n = min(depth, i0 + step) - i0
            x_chunk = tf.slice(x_planes, [sample * depth + i0, 0, 0, 0], [n, -1, -1, -1])
            dy_chunk = tf.reshape(tf.slice(dy_planes, [k * (sample * depth + i0), 0, 0, 0], [k * n, -1, -1, -1]),
                                  (n, k, *dy.shape[2:]))
            for a in range(k):
                with tf.control_dependencies(taps):  # one tap's copy at a time
                    taps[a] = taps[a] + tf.cast(tf.raw_ops.Conv2DBackpropFilter(
                        input=dy_chunk[:, a], filter_sizes=filter_sizes, out_backprop=x_chunk,
                        strides=[1, k, k, 1], padding="SAME"), tf.float32)
    return tf.stack(taps)


def conv3d_planewise_grad(x: tf.Tensor, kernel: tf.Tensor, stride: int = 1) -> tf.Tensor:
    """``tf.nn.conv3d(x, kernel, stride, "SAME")`` with a 2-D weight gradient.

    A 3x3x3 kernel takes ``planewise_weight_grad``, a 1x1x1 one (stride 1) ``pointwise_weight_grad``.

    Args:
        x: ``(batch, D, H, W, C_in)``, static batch and depth (even sizes for ``stride=2``).
        kernel: ``(3, 3, 3, C_in, C_out)`` or ``(1, 1, 1, C_in, C_out)``, ``x``'s dtype.
        stride: 1 or 2 on every spatial axis (default 1; 1 for a 1x1x1 kernel).

    Returns:
        ``(batch, D / stride, H / stride, W / stride, C_out)``; its input gradient is TF's
        ``Conv3DBackpropInputV2``.
    """
    strides = [1, stride, stride, stride, 1]

    @tf.custom_gradient
    def conv(x, kernel):
        y = tf.nn.conv3d(x, kernel, strides=strides, padding="SAME")

        def grad(dy):
            dx = tf.raw_ops.Conv3DBackpropInputV2(input_sizes=tf.shape(x), filter=kernel, out_backprop=dy,
                                                  strides=strides, padding="SAME")
            if tuple(kernel.shape[:3]) == (1, 1, 1):
                return dx, pointwise_weight_grad(x, dy)
            return dx, planewise_weight_grad(x, dy, kernel.shape, stride)

        return y, grad

    return conv(x, kernel)


def conv3d_transpose_2d_grad(x: tf.Tensor, kernel: tf.Tensor, stride: int) -> tf.Tensor:
    """A transposed conv with kernel == stride (TF's ``Conv3DBackpropInputV2``), with ``transposed_weight_grad``.

    Args:
        x: ``(batch, D, H, W, C_in)``, static shape.
        kernel: ``(k, k, k, C_out, C_in)`` with ``k == stride``, ``x``'s dtype.
        stride: ``k``.

    Returns:
        ``(batch, k*D, k*H, k*W, C_out)``, without bias; its input gradient is TF's conv3d.
    """
    strides = [1, stride, stride, stride, 1]
    out_shape = [x.shape[0], *(stride * s for s in x.shape[1:4]), kernel.shape[3]]

    @tf.custom_gradient
    def up(x, kernel):
        y = tf.raw_ops.Conv3DBackpropInputV2(input_sizes=tf.constant(out_shape, tf.int32), filter=kernel,
                                             out_backprop=x, strides=strides, padding="SAME")

        def grad(dy):
            dx = tf.nn.conv3d(dy, kernel, strides=strides, padding="SAME")
            return dx, tf.cast(transposed_weight_grad(dy, x, stride), kernel.dtype)

        return y, grad

    return up(x, kernel)


@keras.saving.register_keras_serializable(package="bigmem")
class Conv3D(keras.layers.Conv3D):
    """``keras.layers.Conv3D`` (channels last), with the planewise weight gradient where it pays.

    Same arguments, weights and outputs as ``keras.layers.Conv3D``. Two paths replace its
    convolution for inputs of static shape: past the kernel element limit (nets/limits.py) the
    conv runs in depth slabs (``conv3d_slabs``, "same" padding, no dilation or
    groups); and a 3x3x3 "same" conv with stride 1 or 2 takes ``planewise_weight_grad`` for its
    weight gradient where nets/choices.py chooses it for this CPU, precision and channel count.

    Example:
        >>> conv = Conv3D(16, 3, padding="same")
        >>> conv(keras.ops.zeros((1, 32, 32, 32, 8))).shape  # (1, 32, 32, 32, 16)
    """

    def _plain(self, inputs) -> bool:
        """No dilation or groups, channels last, a static 5-D input: what every 2-D weight gradient needs."""
        shape = inputs.shape
        return (tuple(self.dilation_rate) == (1, 1, 1) and self.groups == 1
                and self.data_format == "channels_last" and shape.rank == 5 and None not in shape)

    def _planewise(self, inputs) -> bool:
        strides = tuple(self.strides)
        shape = inputs.shape
        if not (self._plain(inputs) and tuple(self.kernel_size) == (3, 3, 3) and self.padding == "same"
                and strides in ((1, 1, 1), (2, 2, 2))):
            return False
        if strides == (1, 1, 1) and shape[1] == 2 and _precision(inputs) == "bf16":
            # oneDNN's bf16 3-D weight gradient (TF 2.21) is wrong for an input two planes deep with 32 or more
            # channels on an avx512_bf16 EPYC: 85-150% off float32's at 2x1x1 to 2x8x8, or inf/nan, where one
            # more or one fewer plane is within bf16's 0.2%; the planewise gradient is within 0.2% there
            # (benchmarks/results/kernels.md). A U-Net's deepest stage on a small or thin volume has such depth.
            return True
        # Where it pays depends on the ISA class oneDNN runs at (nets/choices.py).
        if not takes_planewise(_precision(inputs), strides[0], shape[-1]):
            return False
        if strides == (1, 1, 1):
            return shape[1] >= 2
        return all(size % 2 == 0 and size >= 4 for size in shape[1:4])

    def _pointwise(self, inputs) -> bool:
        """A 1x1x1 stride-1 conv whose weight gradient runs as a 2-D one on this CPU (nets/choices.py)."""
        return (self._plain(inputs) and tuple(self.kernel_size) == (1, 1, 1) and tuple(self.strides) == (1, 1, 1)
                and planewise_others(_precision(inputs)))

    def _output_shape(self, shape):
        return (shape[0], *(same_padding(size, 1, stride)[0] for size, stride in zip(shape[1:4], self.strides)),
                self.filters)

    def _partitioned(self, inputs) -> bool:
        """Whether the input or output is past the kernel limit, so the conv runs in depth slabs."""
        shape = tuple(inputs.shape)
        return (len(shape) == 5 and None not in shape and self.padding == "same" and self.groups == 1
                and self.data_format == "channels_last" and tuple(self.dilation_rate) == (1, 1, 1)
                and exceeds_limit(shape, self._output_shape(shape)))

    def convolution_op(self, inputs, kernel):
        """Keras's hook: the convolution of ``inputs`` with ``kernel``, by the path that applies."""
        if self._partitioned(inputs):
            kernel = tf.cast(tf.convert_to_tensor(kernel), inputs.dtype)
            strides = tuple(self.strides)
            _observe("conv", inputs, kernel.shape, strides, "slabs")

            def filter_grad(x_slab, dy_slab):
                if self._planewise(x_slab):  # cubic strides only
                    return planewise_weight_grad(x_slab, dy_slab, kernel.shape, strides[0])
                return tf.raw_ops.Conv3DBackpropFilterV2(
                    input=x_slab, filter_sizes=tf.constant(kernel.shape.as_list(), tf.int32), out_backprop=dy_slab,
                    strides=[1, *strides, 1], padding="SAME")

            return conv3d_slabs(inputs, kernel, strides, filter_grad=filter_grad)
        planewise, pointwise = self._planewise(inputs), self._pointwise(inputs)
        _observe("conv", inputs, kernel.shape, self.strides,
                 "planewise" if planewise else "pointwise" if pointwise else "3d")
        if planewise or pointwise:
            # The kernel variable reads as float32 outside Keras's autocast; the conv runs in the input's dtype.
            return conv3d_planewise_grad(inputs, tf.cast(tf.convert_to_tensor(kernel), inputs.dtype),
                                         self.strides[0])
        return super().convolution_op(inputs, kernel)


@keras.saving.register_keras_serializable(package="bigmem")
class Conv3DTranspose(keras.layers.Conv3DTranspose):
    """``keras.layers.Conv3DTranspose`` that runs in depth slabs past the kernel limit (nets/slabs.py).

    Same arguments, weights and outputs as ``keras.layers.Conv3DTranspose``. Only the decoder's
    upsampling form is partitioned (kernel == strides, "same", channels last, static shape):
    each input plane then writes its own output planes. That form's kernel gradient is
    ``transposed_weight_grad`` (2-D) where nets/choices.py says so for this CPU and precision.

    Example:
        >>> up = Conv3DTranspose(8, 2, strides=2, padding="same")
        >>> up(keras.ops.zeros((1, 16, 16, 16, 16))).shape  # (1, 32, 32, 32, 8)
    """

    def call(self, inputs):
        """``(batch, D, H, W, C_in)`` -> ``(batch, sd*D, sh*H, sw*W, filters)`` for strides ``(sd, sh, sw)``."""
        shape = tuple(inputs.shape)
        out_shape = (shape[0], *(self.strides[i] * shape[i + 1] for i in range(3)), self.filters) \
            if len(shape) == 5 and None not in shape else shape
        upsampling = (len(shape) == 5 and None not in shape and tuple(self.kernel_size) == tuple(self.strides)
                      and self.padding == "same"
                      and self.data_format == "channels_last" and tuple(self.dilation_rate) == (1, 1, 1)
                      and self.output_padding is None)
        # The 2-D kernel gradient is written for cubic strides.
        two_d = upsampling and len(set(self.strides)) == 1 and planewise_others(_precision(inputs))
        partitioned = upsampling and exceeds_limit(shape, out_shape)
        _observe("transpose", inputs, self.kernel.shape, self.strides,
                 "slabs" if partitioned else "2d" if two_d else "3d")
        if not (partitioned or two_d):
            return super().call(inputs)
        kernel = tf.cast(tf.convert_to_tensor(self.kernel), inputs.dtype)
        stride = self.strides[0] if two_d else tuple(self.strides)
        if partitioned:
            filter_grad = (lambda dy_slab, x_slab: transposed_weight_grad(dy_slab, x_slab, stride)) if two_d else None
            outputs = conv3d_transpose_slabs(inputs, kernel, stride, filter_grad=filter_grad)
        else:
            outputs = conv3d_transpose_2d_grad(inputs, kernel, stride)
        if self.use_bias:
            outputs = outputs + tf.cast(tf.convert_to_tensor(self.bias), outputs.dtype)
        return outputs if self.activation is None else self.activation(outputs)
