"""Keras's SGD (Nesterov) and Adam, each applied to a weight by one fused TF kernel.

Keras 3 writes an update as separate elementwise ops: SGD with momentum makes five passes over
every weight-sized array (multiply, multiply, subtract, assign, and again for the weight),
Adam about ten. For the kits19 U-Net (31 M weights, 125 MB per fp32 array) that is a fixed
cost per step, whatever the volume, which shows at small volumes. TF's
``ResourceApplyKerasMomentum`` and ``ResourceApplyAdam`` compute the same update in one pass.

The arithmetic is Keras's, to rounding:
- SGD: ``m = momentum * m - lr * g``; Nesterov ``w += momentum * m - lr * g``, else ``w += m``.
- Adam: ``m += (1 - b1)(g - m)``, ``v += (1 - b2)(g^2 - v)``,
  ``w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`` with ``t = iterations + 1``.

``l2`` adds ``l2 * w`` to each gradient first: weight decay as PyTorch's SGD and Adam apply their
``weight_decay`` (nnU-Net's 3e-5), coupled to the gradient and so carried by the momentum. Keras's own
``weight_decay`` is decoupled (AdamW's ``w -= lr * wd * w``), a different recipe.

Under a ``tf.distribute`` strategy (the GPU baseline of ``bigmem compare``) the updates go
through Keras's own ops, which know how to update mirrored variables; so does AMSGrad.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def _fusable(variable) -> bool:
    return not tf.distribute.has_strategy() and isinstance(variable, tf.Variable)


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


class _CoupledL2:
    """``l2``: the coupled weight decay every gradient gets before the update (0: none)."""

    def __init__(self, *args, l2: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.l2 = float(l2)

    def with_l2(self, gradient, variable):
        if not self.l2:
            return gradient
        return gradient + tf.cast(self.l2, gradient.dtype) * tf.cast(_tf_variable(variable), gradient.dtype)

    def get_config(self):
        return {**super().get_config(), "l2": self.l2}


@keras.saving.register_keras_serializable(package="bigmem")
class FusedSGD(_CoupledL2, keras.optimizers.SGD):
    """``keras.optimizers.SGD`` whose momentum update is ``ResourceApplyKerasMomentum``."""

    def update_step(self, gradient, variable, learning_rate):
        gradient = self.with_l2(gradient, variable)
        if self.momentum == 0 or not _fusable(variable):
            return super().update_step(gradient, variable, learning_rate)
        momentum = _tf_variable(self.momentums[self._get_variable_index(variable)])
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=momentum.handle, lr=tf.cast(learning_rate, variable.dtype),
            grad=tf.cast(gradient, variable.dtype), momentum=tf.cast(self.momentum, variable.dtype),
            use_locking=False, use_nesterov=self.nesterov)


@keras.saving.register_keras_serializable(package="bigmem")
class FusedAdam(_CoupledL2, keras.optimizers.Adam):
    """``keras.optimizers.Adam`` whose update is ``ResourceApplyAdam`` (not for AMSGrad)."""

    def update_step(self, gradient, variable, learning_rate):
        gradient = self.with_l2(gradient, variable)
        if self.amsgrad or not _fusable(variable):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        return tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=_tf_variable(self._momentums[index]).handle,
            v=_tf_variable(self._velocities[index]).handle,
            beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2, epsilon=tf.cast(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype), use_locking=False, use_nesterov=False)
