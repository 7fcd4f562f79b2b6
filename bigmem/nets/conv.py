"""Conv3D whose bfloat16 weight gradient is computed plane by plane where that is faster.

oneDNN has no brgemm kernel for the bfloat16 weight gradient without AMX; its generic kernel
(``jit_bf16``) slows down as the volume grows. For a 3x3x3, stride-1, "same" convolution the
weight gradient splits along depth into three 2-D weight gradients, one per depth tap ``kd``,
over the stack of depth planes as a batch:

    dW[kd] = sum_d conv2d_weight_grad(x[d + kd - 1], dy[d])

(for kd = 0 the planes d = 1..D-1 read x[0..D-2]; for kd = 2 the planes d = 0..D-2 read
x[1..D-1]; zero padding in depth contributes nothing). Each plane stack is a contiguous slice
without a copy. Timed alone on the dev machine (2 cores, avx512_bf16, TF 2.21), the split
runs 213 -> 174 ms at 128^3 x 32 channels, 92 -> 74 ms at 96^3 x 32, 97 -> 83 ms at 64^3 x 64,
gains nothing clear from 128 input channels on (39 -> 37 ms at 32^3 x 128) and is slower in
float32 (108 -> 127 ms at 96^3 x 32); so it is used for bfloat16 with at most
``PLANEWISE_MAX_IN_CHANNELS`` input channels. Forward and input gradient are TF's own kernels either way.
"""

from __future__ import annotations

import keras
import tensorflow as tf

PLANEWISE_MAX_IN_CHANNELS = 64


def planewise_weight_grad(x: tf.Tensor, dy: tf.Tensor, kernel_shape) -> tf.Tensor:
    """The weight gradient of a 3x3x3 stride-1 "same" conv3d, as three batched conv2d gradients.

    ``x`` and ``dy`` are viewed as stacks of planes, (B*D, H, W, C), and every slice taken is a
    range of whole planes of one sample: TF's Slice returns such a range without copying it.
    """
    batch, depth = x.shape[0], x.shape[1]
    filter_sizes = tf.constant([3, 3, kernel_shape[3], kernel_shape[4]])

    def stack(t):
        return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))

    x_planes, dy_planes = stack(x), stack(dy)

    def planes(t, sample, start, stop):
        return tf.slice(t, tf.stack([sample * depth + start, 0, 0, 0]), tf.stack([stop - start, -1, -1, -1]))

    def grad_2d(sample, x_range, dy_range):
        return tf.raw_ops.Conv2DBackpropFilter(input=planes(x_planes, sample, *x_range), filter_sizes=filter_sizes,
                                               out_backprop=planes(dy_planes, sample, *dy_range),
                                               strides=[1, 1, 1, 1], padding="SAME")

    # Depth tap kd pairs output plane d with input plane d + kd - 1.
    taps = ((0, depth - 1), (1, depth)), ((0, depth), (0, depth)), ((1, depth), (0, depth - 1))
    return tf.stack([tf.add_n([grad_2d(sample, *tap) for sample in range(batch)]) for tap in taps])


def conv3d_planewise_grad(x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    """tf.nn.conv3d(x, kernel, stride 1, "SAME") with the weight gradient of planewise_weight_grad."""

    @tf.custom_gradient
    def conv(x, kernel):
        y = tf.nn.conv3d(x, kernel, strides=[1, 1, 1, 1, 1], padding="SAME")

        def grad(dy):
            dx = tf.raw_ops.Conv3DBackpropInputV2(input_sizes=tf.shape(x), filter=kernel, out_backprop=dy,
                                                  strides=[1, 1, 1, 1, 1], padding="SAME")
            return dx, planewise_weight_grad(x, dy, kernel.shape)

        return y, grad

    return conv(x, kernel)


@keras.saving.register_keras_serializable(package="bigmem")
class Conv3D(keras.layers.Conv3D):
    """``keras.layers.Conv3D`` (channels last), with the planewise bfloat16 weight gradient where it pays."""

    def _planewise(self, inputs, kernel) -> bool:
        return (inputs.dtype == tf.bfloat16 and tuple(self.kernel_size) == (3, 3, 3)
                and tuple(self.strides) == (1, 1, 1) and tuple(self.dilation_rate) == (1, 1, 1)
                and self.padding == "same" and self.groups == 1 and self.data_format == "channels_last"
                and inputs.shape.rank == 5 and inputs.shape[0] is not None and inputs.shape[1] is not None
                and inputs.shape[1] >= 2
                and kernel.shape[3] <= PLANEWISE_MAX_IN_CHANNELS)

    def convolution_op(self, inputs, kernel):
        if self._planewise(inputs, kernel):
            # The kernel variable reads as float32 outside Keras's autocast; the conv runs in bf16.
            return conv3d_planewise_grad(inputs, tf.cast(tf.convert_to_tensor(kernel), inputs.dtype))
        return super().convolution_op(inputs, kernel)
