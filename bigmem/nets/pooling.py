"""Max pooling that runs in depth slabs past the kernel limit (nets/slabs.py)."""

from __future__ import annotations

import keras

from bigmem.nets.slabs import exceeds_limit, max_pool3d_slabs


@keras.saving.register_keras_serializable(package="bigmem")
class MaxPooling3D(keras.layers.MaxPooling3D):
    """``keras.layers.MaxPooling3D``; a cubic, non-overlapping "valid" pool past the limit runs in depth slabs."""

    def call(self, inputs):
        shape = tuple(inputs.shape)
        if (len(shape) == 5 and None not in shape and exceeds_limit(shape) and self.padding == "valid"
                and len(set(self.pool_size)) == 1 and tuple(self.strides) == tuple(self.pool_size)
                and self.data_format == "channels_last"):
            return max_pool3d_slabs(inputs, self.pool_size[0])
        return super().call(inputs)
