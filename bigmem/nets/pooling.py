"""Max pooling that runs in depth slabs past its kernel limit (nets/limits.py, nets/slabs.py)."""

from __future__ import annotations

import keras

from bigmem.nets.limits import max_pool_elements
from bigmem.nets.slabs import exceeds_limit, max_pool3d_slabs


@keras.saving.register_keras_serializable(package="bigmem")
class MaxPooling3D(keras.layers.MaxPooling3D):
    """``keras.layers.MaxPooling3D``; a non-overlapping "valid" pool past the limit runs in depth slabs.

    Same arguments and outputs as ``keras.layers.MaxPooling3D``; the slab path
    (``max_pool3d_slabs``) applies to channels-last inputs of static shape past pooling's own
    element limit (``max_pool_elements``, past 2^32: TF's pooling was measured right further
    than its convolutions).

    Example:
        >>> pool = MaxPooling3D(2)
        >>> pool(keras.ops.zeros((1, 32, 32, 32, 8))).shape  # (1, 16, 16, 16, 8)
    """

    def call(self, inputs):
        """``(batch, D, H, W, C)`` -> ``(batch, D // pd, H // ph, W // pw, C)`` for pool size ``(pd, ph, pw)``."""
        shape = tuple(inputs.shape)
        if (len(shape) == 5 and None not in shape and exceeds_limit(shape, limit=max_pool_elements())
                and self.padding == "valid" and tuple(self.strides) == tuple(self.pool_size)
                and self.data_format == "channels_last"):
            return max_pool3d_slabs(inputs, tuple(self.pool_size))
        return super().call(inputs)
