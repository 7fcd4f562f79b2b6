"""Instance/group normalisation fused with its activation, keeping only its input for backward.

Keras's GroupNormalization followed by ReLU keeps several full-size intermediates per conv
unit for the backward pass (the centred input, the normalised input, the scaled output, the
activation output), in float32 even under mixed_bfloat16. ``NormActivation`` computes the same
function but its custom gradient keeps only the input (in the compute dtype) and the
per-(sample, group) mean and reciprocal standard deviation, and recomputes the rest in
backward. Statistics and gradients are computed in float32.
"""

from __future__ import annotations

import keras
import tensorflow as tf

ACTIVATIONS = ("relu", "leaky_relu", "linear")


def _grouped(x: tf.Tensor, groups: int) -> tf.Tensor:
    """(B, D, H, W, C) -> (B, D*H*W, G, C/G)."""
    shape = tf.shape(x)
    channels = x.shape[-1]
    return tf.reshape(x, tf.stack([shape[0], -1, groups, channels // groups]))


def fused_norm_activation(x, gamma, beta, *, groups: int, epsilon: float, activation: str, negative_slope: float):
    """act(gamma * (x - mean) / sqrt(var + eps) + beta), stats over space and each channel group."""
    channels = x.shape[-1]

    def gate(z):
        if activation == "relu":
            return tf.nn.relu(z), tf.cast(z > 0, tf.float32)
        if activation == "leaky_relu":
            return tf.where(z > 0, z, negative_slope * z), tf.where(z > 0, 1.0, negative_slope)
        return z, None

    @tf.custom_gradient
    def forward(x, gamma, beta):
        xg = tf.cast(_grouped(x, groups), tf.float32)
        mean = tf.reduce_mean(xg, axis=(1, 3), keepdims=True)
        var = tf.reduce_mean(tf.math.squared_difference(xg, mean), axis=(1, 3), keepdims=True)
        rstd = tf.math.rsqrt(var + epsilon)
        g = tf.reshape(gamma, (1, 1, groups, channels // groups))
        b = tf.reshape(beta, (1, 1, groups, channels // groups))
        y, _ = gate((xg - mean) * rstd * g + b)
        y = tf.reshape(tf.cast(y, x.dtype), tf.shape(x))

        def backward(dy):
            # The recomputation must wait for dy: without this edge the graph executor may run
            # it as soon as the forward values exist, keeping x-hat alive as if it were stored.
            with tf.control_dependencies([dy]):
                x_again = tf.identity(x)
            xhat = (tf.cast(_grouped(x_again, groups), tf.float32) - mean) * rstd
            dz = tf.cast(_grouped(dy, groups), tf.float32)
            _, slope = gate(xhat * g + b)
            if slope is not None:
                dz = dz * slope
            dgamma = tf.reshape(tf.reduce_sum(dz * xhat, axis=(0, 1)), (channels,))
            dbeta = tf.reshape(tf.reduce_sum(dz, axis=(0, 1)), (channels,))
            dxhat = dz * g
            mean_dxhat = tf.reduce_mean(dxhat, axis=(1, 3), keepdims=True)
            mean_dxhat_xhat = tf.reduce_mean(dxhat * xhat, axis=(1, 3), keepdims=True)
            dx = (dxhat - mean_dxhat - xhat * mean_dxhat_xhat) * rstd
            return tf.reshape(tf.cast(dx, x.dtype), tf.shape(x)), dgamma, dbeta

        return y, backward

    return forward(x, gamma, beta)


@keras.saving.register_keras_serializable(package="bigmem")
class NormActivation(keras.layers.Layer):
    """Group normalisation (``groups=-1``: instance normalisation) fused with an activation."""

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
        channels = int(input_shape[-1])
        groups = channels if self.groups == -1 else self.groups
        if channels % groups:
            raise ValueError(f"{channels} channels cannot be split into {groups} groups")
        self._num_groups = groups
        self.gamma = self.add_weight(shape=(channels,), name="gamma", dtype=self.variable_dtype,
                                     initializer="zeros" if self.zero_init else "ones")
        self.beta = self.add_weight(shape=(channels,), name="beta", dtype=self.variable_dtype, initializer="zeros")

    def call(self, x):
        gamma = tf.cast(tf.convert_to_tensor(self.gamma.value if hasattr(self.gamma, "value") else self.gamma),
                        tf.float32)
        beta = tf.cast(tf.convert_to_tensor(self.beta.value if hasattr(self.beta, "value") else self.beta),
                       tf.float32)
        return fused_norm_activation(tf.cast(x, self.compute_dtype), gamma, beta, groups=self._num_groups,
                                     epsilon=self.epsilon, activation=self.activation,
                                     negative_slope=self.negative_slope)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "groups": self.groups, "epsilon": self.epsilon,
                "activation": self.activation, "negative_slope": self.negative_slope, "zero_init": self.zero_init}
