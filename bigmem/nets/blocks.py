"""The blocks a 3D U-Net is made of. Each reports the feature-map elements it produces.

``feature_map_elements(spatial_shape)`` counts, per sample, the elements of every tensor the
block creates in its forward pass for an input of ``spatial_shape`` (D, H, W). The memory
estimator sums these block by block (as nnU-Net's planner and dynamic-network-architectures do);
it never inspects layer types from outside.
"""

from __future__ import annotations

import math
from typing import Sequence

import keras

from bigmem.config.options import Activation, Downsampling, Norm
from bigmem.nets.conv import Conv3D, Conv3DTranspose
from bigmem.nets.limits import exceeds_limit, slab_elements
from bigmem.nets.norm_act import NormActivation
from bigmem.nets.pooling import MaxPooling3D
from bigmem.units import as_shape

Shape3D = Sequence[int]

# Epsilons follow the reference implementations: PyTorch's InstanceNorm3d (MLPerf, nnU-Net)
# uses 1e-5; Keras BatchNormalization keeps its own default (1e-3), as IntelAI/unet did.
INSTANCE_NORM_EPSILON = 1e-5
LEAKY_RELU_SLOPE = 0.01  # nnU-Net's LeakyReLU negative slope
# Two C -> C convolutions beat one 2C -> C on oneDNN from C = 16 up, and lose below (timings:
# benchmarks/results/kernels.md).
SPLIT_SKIP_MIN_FILTERS = 16


def _voxels(spatial_shape: Shape3D) -> int:
    return int(math.prod(spatial_shape))


def _plain(value: tuple[int, int, int]) -> int | list[int]:
    """``value`` as get_config saves it: one int when every axis has it (as models saved before per-axis sizes)."""
    return value[0] if len(set(value)) == 1 else list(value)


def _divided(spatial_shape: Shape3D, factors: Sequence[int]) -> tuple[int, ...]:
    return tuple(s // f for s, f in zip(spatial_shape, factors))


def _multiplied(spatial_shape: Shape3D, factors: Sequence[int]) -> tuple[int, ...]:
    return tuple(s * f for s, f in zip(spatial_shape, factors))


def _slab_temporaries(in_shape: Sequence[int], out_shape: Sequence[int], stock_layers: bool) -> int:
    """Elements of one depth slab's result where an op on these one-sample shapes runs in slabs, else 0.

    Past the kernel limit bigmem's conv, transposed conv and pool write each slab's result into
    the full output and free it before the next (nets/slabs.py); a slab has at most
    ``slab_elements`` of the wider plane. Keras's stock layers have no slab path.
    """
    if stock_layers or not exceeds_limit(in_shape, out_shape):
        return 0
    return slab_elements(max(math.prod(in_shape[2:]), math.prod(out_shape[2:])))


def _norm_inference_elements(norm_layer, out_shape: Sequence[int]) -> int:
    """Elements live while a norm layer runs at inference: its input, its output and any temporary.

    Three tensors of the output's size (the input, a temporary: the normalised tensor before the
    activation or ``x * scale`` before ``+ shift``, the output), except two where there is no
    temporary: bigmem's norm past the kernel limit (slabs activate in place) and its instance norm
    without an activation (one fused batch norm). ``out_shape`` is one sample's ``(1, D, H, W, C)``.
    """
    if norm_layer is None:
        return 0
    out = math.prod(out_shape)
    if isinstance(norm_layer, NormActivation):
        instance_linear = norm_layer.groups in (-1, out_shape[-1]) and norm_layer.activation == "linear"
        if exceeds_limit(out_shape) or instance_linear:
            return 2 * out
    return 3 * out


def make_norm(norm: Norm, groups: int, *, zero_init: bool, dtype, name: str, activation: str = "linear",
              fused: bool = True):
    """The normalisation layer for ``norm`` (None for Norm.NONE); ``zero_init`` starts its scale at 0.

    Instance and group norms are ``NormActivation`` layers that may carry the following
    ``activation`` (fused, see norm_act.py); with ``fused=False`` they are Keras's own
    ``GroupNormalization`` (what a plain Keras model uses; the speed benchmark's baseline).
    Batch norm is Keras's layer, always linear.

    Args:
        norm: which normalisation.
        groups: channel groups of a group norm (ignored by the others).
        zero_init: start the scale (gamma) at 0 instead of 1.
        dtype: the layer's dtype policy.
        name: the layer's name.
        activation: the activation a fused norm applies (default ``"linear"``: none).
        fused: ``NormActivation`` (default) rather than Keras's ``GroupNormalization``.

    Returns:
        A Keras layer mapping ``(batch, D, H, W, C)`` to the same shape, or None for Norm.NONE.
    """
    if norm in (Norm.INSTANCE, Norm.GROUP) and not fused:
        return keras.layers.GroupNormalization(groups=-1 if norm is Norm.INSTANCE else groups,
                                               epsilon=INSTANCE_NORM_EPSILON,
                                               gamma_initializer="zeros" if zero_init else "ones", dtype=dtype,
                                               name=name)
    if norm in (Norm.INSTANCE, Norm.GROUP):
        return NormActivation(groups=-1 if norm is Norm.INSTANCE else groups, epsilon=INSTANCE_NORM_EPSILON,
                              activation=activation, negative_slope=LEAKY_RELU_SLOPE, zero_init=zero_init,
                              dtype=dtype, name=name)
    if norm is Norm.BATCH:
        return keras.layers.BatchNormalization(gamma_initializer="zeros" if zero_init else "ones", dtype=dtype,
                                               name=name)
    return None


def fuses_activation(norm: Norm, fused: bool = True) -> bool:
    """Whether ``norm``'s layer can apply the activation itself (keeping fewer tensors).

    Args:
        norm: which normalisation.
        fused: whether bigmem's fused layers are used (False: ``stock_layers``).

    Returns:
        True for instance and group norm when ``fused``.
    """
    return fused and norm in (Norm.INSTANCE, Norm.GROUP)


def make_activation(activation: Activation, *, dtype, name: str):
    """The Keras activation layer: ``LeakyReLU`` (slope LEAKY_RELU_SLOPE) or ``ReLU``.

    Args:
        activation: which activation.
        dtype: the layer's dtype policy.
        name: the layer's name.

    Returns:
        A shape-preserving Keras layer.
    """
    if activation is Activation.LEAKY_RELU:
        return keras.layers.LeakyReLU(negative_slope=LEAKY_RELU_SLOPE, dtype=dtype, name=name)
    return keras.layers.ReLU(dtype=dtype, name=name)


class _Block(keras.layers.Layer):
    """Common options of the convolutional blocks, kept as plain values for get_config."""

    def __init__(
        self,
        filters: int,
        *,
        strides: int | Sequence[int] = 1,
        kernel_size: int | Sequence[int] = 3,
        norm: str = "instance",
        groups: int = 8,
        activation: str = "relu",
        use_bias: bool = False,
        stock_layers: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.strides = as_shape(strides)
        self.kernel_size = as_shape(kernel_size)
        self.norm = Norm(norm)
        self.groups = int(groups)
        self.activation = Activation(activation)
        self.use_bias = bool(use_bias)
        self.stock_layers = bool(stock_layers)

    def _common(self) -> dict:
        """The options a block passes on to the blocks it is made of."""
        return dict(kernel_size=self.kernel_size, norm=self.norm.value, groups=self.groups,
                    activation=self.activation.value, use_bias=self.use_bias, stock_layers=self.stock_layers,
                    dtype=self.dtype_policy)

    def _norm(self, *, zero_init: bool, name: str, activation: str = "linear"):
        return make_norm(self.norm, self.groups, zero_init=zero_init, dtype=self.dtype_policy, name=name,
                         activation=activation, fused=not self.stock_layers)

    def _conv(self, kernel_size: int | Sequence[int], strides: int | Sequence[int], name: str, *,
              use_bias: bool | None = None):
        layer = keras.layers.Conv3D if self.stock_layers else Conv3D
        return layer(
            self.filters, kernel_size, strides=strides, padding="same",
            use_bias=self.use_bias if use_bias is None else use_bias,
            kernel_initializer="he_normal", dtype=self.dtype_policy, name=name,
        )

    def _out_shape(self, spatial_shape: Shape3D) -> tuple[int, ...]:
        return _divided(spatial_shape, self.strides)

    @staticmethod
    def _conv_macs(conv, in_channels: int, out_voxels: int) -> int:
        """Multiply-adds of a convolution: kernel volume x in x out channels per output voxel."""
        return math.prod(conv.kernel_size) * in_channels * conv.filters * out_voxels

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters, strides=_plain(self.strides), kernel_size=_plain(self.kernel_size),
            norm=self.norm.value, groups=self.groups,
            activation=self.activation.value, use_bias=self.use_bias, stock_layers=self.stock_layers,
        )
        return config


@keras.saving.register_keras_serializable(package="bigmem")
class ConvNormAct(_Block):
    """3x3x3 convolution, then normalisation, then activation.

    Instance/group norm and the activation are one fused layer (norm_act.py): the block keeps
    two tensors for backward (conv output, activation output); with batch norm, three.

    With ``num_inputs=2`` the block takes ``[x, skip]`` and convolves each with its own kernel
    and adds the results: the same function as one convolution of their concatenation (whose
    kernel is the two stacked), without the concatenated copy, and faster on CPU from
    SPLIT_SKIP_MIN_FILTERS channels (oneDNN's 2C -> C weight gradient is the slow part; timings:
    benchmarks/results/kernels.md).

    Args:
        filters: output channels.
        zero_init_scale: start the norm's scale at 0 (default False).
        num_inputs: 1 (default), or 2 for ``[x, skip]`` of the same spatial shape.
        **kwargs: the block options (``strides=1``, ``norm="instance"``, ``groups=8``,
            ``activation="relu"``, ``use_bias=False``, ``stock_layers=False``) and Keras layer
            arguments (``name``, ``dtype``).

    Raises:
        ValueError: ``num_inputs`` is not 1 or 2.

    Example:
        >>> block = ConvNormAct(16, strides=2)
        >>> block(keras.ops.zeros((1, 32, 32, 32, 8))).shape  # (1, 16, 16, 16, 16)
    """

    def __init__(self, filters: int, *, zero_init_scale: bool = False, num_inputs: int = 1, **kwargs):
        super().__init__(filters, **kwargs)
        self.zero_init_scale = bool(zero_init_scale)
        self.num_inputs = int(num_inputs)
        if self.num_inputs not in (1, 2):
            raise ValueError(f"num_inputs must be 1 or 2, got {num_inputs}")
        self.conv = self._conv(self.kernel_size, self.strides, "conv")
        # The second input's kernel; a bias, when used, belongs to the first convolution only.
        self.conv_skip = (self._conv(self.kernel_size, self.strides, "conv_skip", use_bias=False)
                          if self.num_inputs == 2 else None)
        fused = fuses_activation(self.norm, not self.stock_layers)
        self.norm_layer = self._norm(zero_init=self.zero_init_scale, name="norm",
                                     activation=self.activation.value if fused else "linear")
        self.act = None if fused else make_activation(self.activation, dtype=self.dtype_policy, name="act")

    def call(self, x, training=None):
        """``(batch, D, H, W, C_in)`` (or ``[x, skip]``) -> ``(batch, D/s, H/s, W/s, filters)``, strides s."""
        if self.conv_skip is not None:
            x, skip = x
            x = self.conv(x) + self.conv_skip(skip)
        else:
            x = self.conv(x)
        if self.norm_layer is not None:
            x = self.norm_layer(x, training=training)
        return x if self.act is None else self.act(x)

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """Per-sample elements of the tensors the block creates for an input of ``(D, H, W)`` voxels."""
        convs = 1 if self.conv_skip is None else 3  # one conv output; or two and their sum
        tensors = convs + (self.norm_layer is not None) + (self.act is not None)  # + norm(+act), separate act
        return tensors * self.filters * _voxels(self._out_shape(spatial_shape))

    def inference_live_elements(self, spatial_shape: Shape3D, in_channels: int) -> int:
        """Elements live at once at the block's peak in an inference pass of one sample, its inputs excepted.

        An inference pass (``training=False``, eager) keeps nothing for backward: each tensor is
        freed after its last use. The peak is the largest of the convolutions (one output; or, with
        two inputs, both outputs and their sum) plus one depth slab where they run in slabs, the
        norm (its input, a temporary, its output: ``_norm_inference_elements``) and a separate
        activation (its input and output). The inputs are the caller's and counted by it.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.
            in_channels: every input's channels (both halves of a skip connection).

        Returns:
            Elements, not bytes.
        """
        out_shape = (1, *self._out_shape(spatial_shape), self.filters)
        out = math.prod(out_shape)
        in_shape = (1, *spatial_shape, in_channels // self.num_inputs)
        convs = (1 if self.conv_skip is None else 3) * out + _slab_temporaries(in_shape, out_shape, self.stock_layers)
        act = 2 * out if self.act is not None else 0
        return max(convs, _norm_inference_elements(self.norm_layer, out_shape), act)

    def forward_macs(self, spatial_shape: Shape3D, in_channels: int) -> int:
        """Multiply-adds of the convolution for an input of ``(D, H, W)`` voxels.

        ``in_channels`` counts every input's channels (both halves of a skip connection).
        """
        return self._conv_macs(self.conv, in_channels, _voxels(self._out_shape(spatial_shape)))

    def get_config(self):
        """The constructor's arguments, for ``from_config`` and saving."""
        return {**super().get_config(), "zero_init_scale": self.zero_init_scale, "num_inputs": self.num_inputs}


@keras.saving.register_keras_serializable(package="bigmem")
class ResidualBlock(_Block):
    """conv-norm-act, conv-norm (scale zero-initialised, Goyal et al. 2017), + shortcut, act.

    The shortcut is the identity when shapes match, else a 1x1x1 (strided) conv and norm. With
    ``pooled_shortcut`` it is ResNet-D's (He et al. 2019), as nnU-Net's residual encoder has it
    (dynamic-network-architectures' ``BasicBlockD``): an average pool by the stride where the block
    strides, then a 1x1x1 conv without bias and a norm where the channels change; the identity
    where neither. nnU-Net zeroes the same last norm's scale and shift at initialisation
    (``init_last_bn_before_add_to_0``); bigmem's shift starts at 0 in every norm.

    Args:
        filters: output channels.
        in_filters: input channels (a projection shortcut when they differ from ``filters``).
        pooled_shortcut: ResNet-D's shortcut (default False: a strided 1x1x1 conv).
        **kwargs: the block options and Keras layer arguments, as ``ConvNormAct``.

    Example:
        >>> block = ResidualBlock(16, in_filters=8)
        >>> block(keras.ops.zeros((1, 32, 32, 32, 8))).shape  # (1, 32, 32, 32, 16)
        >>> ResidualBlock(16, in_filters=16, strides=2, pooled_shortcut=True).proj  # None: the pool alone
    """

    def __init__(self, filters: int, *, in_filters: int, pooled_shortcut: bool = False, **kwargs):
        super().__init__(filters, **kwargs)
        self.in_filters = int(in_filters)
        self.pooled_shortcut = bool(pooled_shortcut)
        self.first = ConvNormAct(self.filters, strides=self.strides, name="first", **self._common())
        self.conv = self._conv(self.kernel_size, 1, "conv")
        self.norm_layer = self._norm(zero_init=True, name="norm")
        strided = self.strides != (1, 1, 1)
        self.pool = self.proj = self.proj_norm = None
        if self.pooled_shortcut and strided:
            # No slab path: TF's pooling kernels were measured right past 2^32 elements (nets/limits.py,
            # MAX_POOL_ELEMENTS, for max pooling).
            self.pool = keras.layers.AveragePooling3D(self.strides, dtype=self.dtype_policy, name="pool")
        if self.in_filters != self.filters or (strided and not self.pooled_shortcut):
            self.proj = (self._conv(1, 1, "proj", use_bias=False) if self.pooled_shortcut
                         else self._conv(1, self.strides, "proj"))
            self.proj_norm = self._norm(zero_init=False, name="proj_norm")
        self.add = keras.layers.Add(dtype=self.dtype_policy, name="add")
        self.act = make_activation(self.activation, dtype=self.dtype_policy, name="act")

    @property
    def needs_projection(self) -> bool:
        """Whether the shortcut convolves (it is a pool alone, or the identity, otherwise)."""
        return self.proj is not None

    def call(self, x, training=None):
        """``(batch, D, H, W, in_filters)`` -> ``(batch, D/s, H/s, W/s, filters)``, strides s."""
        shortcut = x if self.pool is None else self.pool(x)
        if self.proj is not None:
            shortcut = self.proj(shortcut)
            if self.proj_norm is not None:
                shortcut = self.proj_norm(shortcut, training=training)
        y = self.conv(self.first(x, training=training))
        if self.norm_layer is not None:
            y = self.norm_layer(y, training=training)
        return self.act(self.add([y, shortcut]))

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """Per-sample elements of the tensors the block creates for an input of ``(D, H, W)`` voxels."""
        out_voxels = _voxels(self._out_shape(spatial_shape))
        out = self.filters * out_voxels
        has_norm = self.norm_layer is not None
        second = (1 + has_norm) * out  # conv, norm
        pooled = self.in_filters * out_voxels if self.pool is not None else 0
        projection = (1 + has_norm) * out if self.needs_projection else 0
        return self.first.feature_map_elements(spatial_shape) + second + pooled + projection + 2 * out  # add, act

    def inference_live_elements(self, spatial_shape: Shape3D, in_channels: int) -> int:
        """Elements live at once at the block's peak in an inference pass of one sample, its input excepted.

        In call order: the shortcut (the pool; its conv, reading the pooled tensor or the input;
        its norm), then held while the first block, the conv (with the first block's output), the
        norm, the add (with the norm's output) and the activation (with the norm's output and the
        sum, still referenced) run.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.
            in_channels: the input's channels.

        Returns:
            Elements, not bytes.
        """
        out_spatial = self._out_shape(spatial_shape)
        out_shape = (1, *out_spatial, self.filters)
        out = math.prod(out_shape)
        shortcut, phases = 0, []
        proj_in = (1, *spatial_shape, in_channels)
        if self.pool is not None:
            shortcut = in_channels * _voxels(out_spatial)  # the pooled tensor
            phases.append(shortcut)
            proj_in = (1, *out_spatial, in_channels)
        if self.needs_projection:
            pooled = shortcut  # read by the conv, then freed
            phases.append(pooled + out + _slab_temporaries(proj_in, out_shape, self.stock_layers))
            phases.append(_norm_inference_elements(self.proj_norm, out_shape))
            shortcut = out
        phases.extend(shortcut + phase for phase in (
            self.first.inference_live_elements(spatial_shape, in_channels),
            2 * out + _slab_temporaries(out_shape, out_shape, self.stock_layers),  # first's output, conv
            max(_norm_inference_elements(self.norm_layer, out_shape), out),
            3 * out))  # the norm's output, the sum, the activation
        return max(phases)

    def forward_macs(self, spatial_shape: Shape3D, in_channels: int) -> int:
        """Multiply-adds of the block's convolutions (projection included) for an input of ``(D, H, W)``."""
        out_voxels = _voxels(self._out_shape(spatial_shape))
        macs = self.first.forward_macs(spatial_shape, in_channels)
        macs += self._conv_macs(self.conv, self.filters, out_voxels)
        return macs + (self._conv_macs(self.proj, in_channels, out_voxels) if self.needs_projection else 0)

    def get_config(self):
        """The constructor's arguments, for ``from_config`` and saving."""
        return {**super().get_config(), "in_filters": self.in_filters, "pooled_shortcut": self.pooled_shortcut}


def _make_blocks(owner: _Block, count: int, in_filters: int, first_strides: int | Sequence[int], residual: bool,
                 first_inputs: int = 1, pooled_shortcut: bool = False):
    common = owner._common()
    blocks = []
    for index in range(count):
        strides = first_strides if index == 0 else 1
        if residual:
            blocks.append(ResidualBlock(owner.filters, in_filters=in_filters if index == 0 else owner.filters,
                                        strides=strides, pooled_shortcut=pooled_shortcut, name=f"block{index}",
                                        **common))
        else:
            blocks.append(ConvNormAct(owner.filters, strides=strides, num_inputs=first_inputs if index == 0 else 1,
                                      name=f"block{index}", **common))
    return blocks


@keras.saving.register_keras_serializable(package="bigmem")
class EncoderStage(_Block):
    """One encoder level: optional downsampling (max pool, or a strided first conv), then blocks.

    Args:
        filters: output channels.
        in_filters: input channels.
        num_blocks: blocks in the level (default 2).
        downsampling: ``"maxpool"``, ``"strided"`` or None (default: the full-resolution level).
        scale: the downsampling factor, one per axis ``(D, H, W)`` or one for all (default 2).
        residual: ``ResidualBlock`` instead of ``ConvNormAct`` (default False).
        pooled_shortcut: the residual blocks' ResNet-D shortcut (``ResidualBlock``; default False).
        stem: first a conv -> norm -> activation from ``in_filters`` to ``filters`` channels, stride 1
            (nnU-Net's residual encoder's stem, before its first stage); only at full resolution (default False).
        **kwargs: the block options and Keras layer arguments, as ``ConvNormAct``.

    Raises:
        ValueError: ``stem`` with ``downsampling``, or ``pooled_shortcut`` without ``residual``.

    Example:
        >>> stage = EncoderStage(32, in_filters=16, downsampling="maxpool")
        >>> stage(keras.ops.zeros((1, 32, 32, 32, 16))).shape  # (1, 16, 16, 16, 32)
    """

    def __init__(self, filters: int, *, in_filters: int, num_blocks: int = 2, downsampling: str | None = None,
                 scale: int | Sequence[int] = 2, residual: bool = False, pooled_shortcut: bool = False,
                 stem: bool = False, **kwargs):
        super().__init__(filters, **kwargs)
        self.in_filters = int(in_filters)
        self.num_blocks = int(num_blocks)
        self.downsampling = Downsampling(downsampling) if downsampling else None
        self.scale = as_shape(scale) if self.downsampling else (1, 1, 1)
        self.residual = bool(residual)
        self.pooled_shortcut = bool(pooled_shortcut)
        if stem and self.downsampling:
            raise ValueError("a stem runs at full resolution: a stage with a stem cannot downsample")
        if self.pooled_shortcut and not self.residual:
            raise ValueError("pooled_shortcut is the residual blocks' shortcut: give residual=True too")
        self.stem = ConvNormAct(self.filters, name="stem", **self._common()) if stem else None
        self.pool = None
        if self.downsampling is Downsampling.MAXPOOL:
            pool = keras.layers.MaxPooling3D if self.stock_layers else MaxPooling3D
            self.pool = pool(self.scale, dtype=self.dtype_policy, name="pool")
        first_strides = self.scale if self.downsampling is Downsampling.STRIDED else 1
        block_in = self.filters if self.stem is not None else self.in_filters
        self.blocks = _make_blocks(self, self.num_blocks, block_in, first_strides, self.residual,
                                   pooled_shortcut=self.pooled_shortcut)

    def call(self, x, training=None):
        """``(batch, D, H, W, in_filters)`` -> ``(batch, D', H', W', filters)``, divided by ``scale`` if it pools."""
        if self.stem is not None:
            x = self.stem(x, training=training)
        if self.pool is not None:
            x = self.pool(x)
        for block in self.blocks:
            x = block(x, training=training)
        return x

    def output_spatial_shape(self, spatial_shape: Shape3D) -> tuple[int, ...]:
        """The output's ``(D, H, W)`` for an input of ``spatial_shape``."""
        return _divided(spatial_shape, self.scale)

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """Per-sample elements of the tensors the stage creates for an input of ``(D, H, W)`` voxels."""
        total = self.stem.feature_map_elements(spatial_shape) if self.stem is not None else 0
        if self.pool is not None:
            spatial_shape = _divided(spatial_shape, self.scale)
            total += self.in_filters * _voxels(spatial_shape)
        for block in self.blocks:
            total += block.feature_map_elements(spatial_shape)
            spatial_shape = block._out_shape(spatial_shape)
        return total

    def inference_live_elements(self, spatial_shape: Shape3D) -> int:
        """Elements live at once at the stage's peak in an inference pass of one sample, its input excepted.

        The stem's peak, the pooled tensor (plus one depth slab where the pool runs in slabs),
        then each block's peak with the tensor it reads (the stem's output, the pooled one, or the
        previous block's output); the stage's input is the caller's (an encoder output it keeps
        as a skip) and counted by it.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.

        Returns:
            Elements, not bytes.
        """
        phases, held, channels = [], 0, self.in_filters
        if self.stem is not None:
            phases.append(self.stem.inference_live_elements(spatial_shape, channels))
            channels = self.filters
            held = channels * _voxels(spatial_shape)
        if self.pool is not None:
            in_shape = (1, *spatial_shape, channels)
            spatial_shape = _divided(spatial_shape, self.scale)
            held = channels * _voxels(spatial_shape)
            phases.append(held + _slab_temporaries(in_shape, (1, *spatial_shape, channels), self.stock_layers))
        for block in self.blocks:
            phases.append(held + block.inference_live_elements(spatial_shape, channels))
            spatial_shape, channels = block._out_shape(spatial_shape), self.filters
            held = channels * _voxels(spatial_shape)
        return max(phases)

    def largest_tensor_elements(self, spatial_shape: Shape3D) -> int:
        """Elements of the largest tensor the stage reads or creates for one sample: its input or its output.

        Past the kernel limit the stage's ops that touch it run in depth slabs (nets/slabs.py).

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.

        Returns:
            Elements.
        """
        return max(self.in_filters * _voxels(spatial_shape),
                   self.filters * _voxels(self.output_spatial_shape(spatial_shape)))

    def forward_macs(self, spatial_shape: Shape3D) -> int:
        """Multiply-adds of the stage's convolutions (pooling, norms and activations are not MACs)."""
        total, channels = 0, self.in_filters
        if self.stem is not None:
            total, channels = self.stem.forward_macs(spatial_shape, channels), self.filters
        if self.pool is not None:
            spatial_shape = _divided(spatial_shape, self.scale)
        for block in self.blocks:
            total += block.forward_macs(spatial_shape, channels)
            spatial_shape, channels = block._out_shape(spatial_shape), self.filters
        return total

    def get_config(self):
        """The constructor's arguments, for ``from_config`` and saving."""
        return {**super().get_config(), "in_filters": self.in_filters, "num_blocks": self.num_blocks,
                "downsampling": self.downsampling.value if self.downsampling else None,
                "scale": _plain(self.scale) if self.downsampling else 2, "residual": self.residual,
                "pooled_shortcut": self.pooled_shortcut, "stem": self.stem is not None}


@keras.saving.register_keras_serializable(package="bigmem")
class DecoderStage(_Block):
    """One decoder level: a transposed conv upsampling by ``scale`` (kernel = stride, 2x2x2 by default), join the
    skip, then blocks.

    Plain blocks take the upsampled tensor and the skip as two inputs of their first
    convolution (ConvNormAct with ``num_inputs=2``: no concatenated copy); residual blocks
    (whose shortcut needs the joined tensor), ``stock_layers`` models and levels narrower than
    SPLIT_SKIP_MIN_FILTERS take their concatenation.

    Args:
        filters: output channels (and the skip's channels).
        in_filters: channels of the input from the level below.
        num_blocks: blocks in the level (default 2).
        scale: the upsampling factor, one per axis ``(D, H, W)`` or one for all (default 2): the encoder's
            downsampling at the level below.
        residual: ``ResidualBlock`` instead of ``ConvNormAct`` (default False).
        **kwargs: the block options and Keras layer arguments, as ``ConvNormAct``.

    Example:
        >>> stage = DecoderStage(16, in_filters=32)
        >>> stage([keras.ops.zeros((1, 16, 16, 16, 32)), keras.ops.zeros((1, 32, 32, 32, 16))]).shape
        (1, 32, 32, 32, 16)
    """

    def __init__(self, filters: int, *, in_filters: int, num_blocks: int = 2, scale: int | Sequence[int] = 2,
                 residual: bool = False, **kwargs):
        super().__init__(filters, **kwargs)
        self.in_filters = int(in_filters)
        self.num_blocks = int(num_blocks)
        self.scale = as_shape(scale)
        self.residual = bool(residual)
        # The transposed conv keeps its bias, as in MLPerf's and IntelAI's reference models.
        up = keras.layers.Conv3DTranspose if self.stock_layers else Conv3DTranspose
        self.up = up(self.filters, self.scale, strides=self.scale, padding="same", dtype=self.dtype_policy, name="up")
        joined = self.residual or self.stock_layers or self.filters < SPLIT_SKIP_MIN_FILTERS
        self.concat = keras.layers.Concatenate(axis=-1, dtype=self.dtype_policy, name="concat") if joined else None
        self.blocks = _make_blocks(self, self.num_blocks, 2 * self.filters, 1, self.residual,
                                   first_inputs=1 if joined else 2)

    def call(self, inputs, training=None):
        """Upsample ``x`` by ``scale``, join ``skip``, run the blocks.

        Args:
            inputs: ``[x (batch, D, H, W, in_filters), skip (batch, 2D, 2H, 2W, filters)]`` (the default scale 2).
            training: passed to the norms.

        Returns:
            ``(batch, 2D, 2H, 2W, filters)`` (the default scale 2).
        """
        x, skip = inputs
        x = [self.up(x), skip]
        if self.concat is not None:
            x = self.concat(x)
        for block in self.blocks:
            x = block(x, training=training)
        return x

    def output_spatial_shape(self, spatial_shape: Shape3D) -> tuple[int, ...]:
        """The output's ``(D, H, W)``: the input's times ``scale``."""
        return _multiplied(spatial_shape, self.scale)

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """``spatial_shape`` is the (smaller) shape of the input from the level below."""
        out_shape = self.output_spatial_shape(spatial_shape)
        voxels = _voxels(out_shape)
        total = self.filters * voxels  # transposed conv out
        if self.concat is not None:
            total += 2 * self.filters * voxels
        for block in self.blocks:
            total += block.feature_map_elements(out_shape)
        return total

    def inference_live_elements(self, spatial_shape: Shape3D) -> int:
        """Elements live at once at the stage's peak in an inference pass of one sample, its inputs excepted.

        The upsampled tensor (plus one depth slab where the transposed conv runs in slabs); their
        concatenation where the stage joins them (the upsampled tensor alone is then freed); then
        each block's peak with the tensor(s) it reads. The input from below and the skip are the
        caller's and counted by it.

        Args:
            spatial_shape: the (smaller) shape of the input from the level below.

        Returns:
            Elements, not bytes.
        """
        out_shape = self.output_spatial_shape(spatial_shape)
        out = self.filters * _voxels(out_shape)
        phases = [out + _slab_temporaries((1, *spatial_shape, self.in_filters), (1, *out_shape, self.filters),
                                          self.stock_layers)]
        held = out  # the upsampled tensor, read by the first block beside the skip
        if self.concat is not None:
            phases.append(3 * out)  # the upsampled tensor and the concatenation
            held = 2 * out
        channels = 2 * self.filters
        for block in self.blocks:
            phases.append(held + block.inference_live_elements(out_shape, channels))
            held, channels = out, self.filters
        return max(phases)

    def largest_tensor_elements(self, spatial_shape: Shape3D) -> int:
        """Elements of the largest tensor the stage reads or creates for one sample.

        The input from below, or a tensor at the output's size: the skip and the upsampled
        tensor, or their concatenation where the stage joins them (two-input blocks never form it).
        Past the kernel limit the stage's ops that touch it run in depth slabs (nets/slabs.py).

        Args:
            spatial_shape: the (smaller) shape of the input from the level below.

        Returns:
            Elements.
        """
        joined = 2 if self.concat is not None else 1
        return max(self.in_filters * _voxels(spatial_shape),
                   joined * self.filters * _voxels(self.output_spatial_shape(spatial_shape)))

    def forward_macs(self, spatial_shape: Shape3D) -> int:
        """``spatial_shape`` is the input's; a transposed conv with kernel = stride: in x out MACs per output voxel."""
        out_voxels = _voxels(self.output_spatial_shape(spatial_shape))
        total = self.in_filters * self.filters * out_voxels
        channels = 2 * self.filters
        for block in self.blocks:
            total += block.forward_macs(self.output_spatial_shape(spatial_shape), channels)
            channels = self.filters
        return total

    def get_config(self):
        """The constructor's arguments, for ``from_config`` and saving."""
        return {**super().get_config(), "in_filters": self.in_filters, "num_blocks": self.num_blocks,
                "scale": _plain(self.scale), "residual": self.residual}
