"""UNet3D: a Keras 3 3D U-Net built from a typed ``ModelConfig``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import keras
import tensorflow as tf

from bigmem.config.schema import ExperimentConfig, ModelConfig, check_multiple, check_shape, update
from bigmem.nets.conv import Conv3D
from bigmem.nets.blocks import DecoderStage, EncoderStage, Shape3D, _voxels


def _model_config(config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config  # frozen: shared safely
    resolved = update(ExperimentConfig().model, config, source="UNet3D config")
    resolved.validate()
    return resolved


@keras.saving.register_keras_serializable(package="bigmem")
class UNet3D(keras.Model):
    """3D U-Net on channels-last volumes: ``(batch, D, H, W, in_channels)`` -> float32 logits.

    ``depth`` encoder downsamplings (2x2x2 max pool, or a stride-2 first conv), each level with
    ``blocks_per_level`` 3x3x3 conv -> norm -> activation blocks (residual if ``residual``);
    mirrored by 2x2x2 stride-2 transposed-conv decoder stages joined to the encoder's skip
    tensors, and a 1x1x1 conv head with ``num_outputs`` outputs (the classes, or one per region). Level ``l`` has
    ``min(base_filters * 2**l, max_filters)`` channels. ``kernel_sizes`` and ``strides`` give each stage its own
    kernel and downsampling per axis instead (an anisotropic scan's network: ``config/topology.py``); the
    decoder upsamples by the same factors. ``encoder_blocks`` and ``decoder_blocks`` set each half's block
    counts; ``residual_encoder`` builds nnU-Net's ResEnc U-Net (``ResidualEncoderUNet``): a stem in ``enc0``
    and ResNet-D residual blocks in the encoder, a plain decoder.

    Size contract: every spatial size must be a multiple of its axis's ``divisors``, ``2**depth`` by default
    (``D % 16 == 0`` at the default ``depth=4``), so that each pooled size divides evenly and each decoder
    output matches its skip; ``check_spatial_shape`` raises a ``ConfigError`` naming the nearest valid
    sizes. The network does not check this in ``call``.

    Args:
        config: a ``ModelConfig``, or a mapping of some of its fields (the rest take
            ``ModelConfig``'s defaults: ``depth=4``, ``base_filters=16``, ``max_filters=320``,
            ``blocks_per_level=2``, ``norm="instance"``, ``activation="relu"``,
            ``downsampling="maxpool"``, ``in_channels=1``, ``num_classes=3``).
        **kwargs: passed to ``keras.Model`` (``name``, ``dtype`` such as ``"mixed_bfloat16"``).

    Raises:
        UsageError: ``config`` is a mapping with an unknown field or an invalid value.

    Example:
        >>> net = UNet3D({"depth": 2, "base_filters": 8, "num_classes": 3})
        >>> net(keras.ops.zeros((1, 32, 32, 32, 1))).shape  # (1, 32, 32, 32, 3)
    """

    def __init__(self, config: ModelConfig | Mapping[str, Any], **kwargs):
        super().__init__(**kwargs)
        self.model_config = _model_config(config)
        cfg = self.model_config
        common = dict(norm=cfg.norm.value, groups=cfg.groups, activation=cfg.activation.value,
                      use_bias=cfg.conv_bias, stock_layers=cfg.stock_layers, dtype=self.dtype_policy)
        filters, kernels, strides = cfg.filters, cfg.stage_kernels, cfg.stage_strides
        # nnU-Net's residual encoder: a stem before the first stage, ResNet-D residual blocks in every stage.
        resenc = cfg.residual_encoder
        self.encoder = [
            EncoderStage(filters[level], in_filters=filters[level - 1] if level else cfg.in_channels,
                         num_blocks=blocks, downsampling=cfg.downsampling.value if level else None,
                         scale=strides[level], kernel_size=kernels[level], residual=cfg.residual or resenc,
                         pooled_shortcut=resenc, stem=resenc and not level, name=f"enc{level}", **common)
            for level, blocks in enumerate(cfg.encoder_stage_blocks)
        ]
        # Decoder level l upsamples by the encoder's downsampling into level l + 1 and convolves with level l's
        # kernel, as PlainConvUNet's and ResidualEncoderUNet's decoder (UNetDecoder) does.
        self.decoder = [
            DecoderStage(filters[level], in_filters=filters[level + 1], num_blocks=cfg.decoder_stage_blocks,
                         scale=strides[level + 1], kernel_size=kernels[level], residual=cfg.residual,
                         name=f"dec{level}", **common)
            for level in reversed(range(cfg.depth))
        ]
        head = keras.layers.Conv3D if cfg.stock_layers else Conv3D  # bigmem's runs in slabs past the limit
        self.head = head(cfg.num_outputs, 1, dtype=self.dtype_policy, name="head")
        # Deep supervision: a 1x1x1 head (with bias, as nnU-Net's seg layers) on each lower decoder level
        # whose loss weight is not 0; their logits are returned only in training (``call``).
        self.supervision_heads = {level: head(cfg.num_outputs, 1, dtype=self.dtype_policy, name=f"head{level}")
                                  for level in cfg.supervised_levels}
        # Logits leave the network in float32 so the loss is computed in full precision.
        self.to_float32 = keras.layers.Activation("linear", dtype="float32", name="logits")
        # Names of the stages whose activations are recomputed in the backward pass instead of
        # kept (gradient checkpointing); a training-time choice, so not part of get_config.
        self.recompute: frozenset[str] = frozenset()

    @property
    def stage_names(self) -> list[str]:
        """Names of the encoder then decoder stages, in forward order (``enc0``..``encN``, ``decN-1``..``dec0``)."""
        return [stage.name for stage in (*self.encoder, *self.decoder)]

    def set_recompute(self, stage_names) -> None:
        """Recompute these stages' activations in the backward pass instead of keeping them.

        Gradient checkpointing (``tf.recompute_grad``), applied only when ``training`` is true;
        an empty list turns it off. A training-time choice: not saved by ``get_config``.

        Args:
            stage_names: names from ``stage_names``, e.g. ``["enc0", "dec0"]``.

        Raises:
            ValueError: a name is not one of ``stage_names``.
        """
        unknown = set(stage_names) - set(self.stage_names)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; the stages are {self.stage_names}")
        self.recompute = frozenset(stage_names)

    def _run_stage(self, stage, inputs, training):
        """Call ``stage``; when it is recomputed, keep only its inputs and output for backward."""
        if not (training and stage.name in self.recompute):
            return stage(inputs, training=training)

        @tf.autograph.experimental.do_not_convert
        def forward(*tensors):
            return stage(list(tensors) if len(tensors) > 1 else tensors[0], training=True)

        tensors = inputs if isinstance(inputs, list) else [inputs]
        return tf.recompute_grad(forward)(*tensors)

    def build(self, input_shape):
        """Create every weight by tracing ``call`` symbolically (no tensor is computed)."""
        spatial = tuple(s or d for s, d in zip(input_shape[1:-1], self.model_config.divisors))
        self.built = True  # before the trace: ``call`` must not re-enter build
        self.compute_output_spec(keras.KerasTensor((1, *spatial, input_shape[-1])))
        for level, head in self.supervision_heads.items():  # the trace above is not training: build them here
            head.build((None, None, None, None, self.model_config.filters[level]))

    def call(self, x, training=None):
        """The forward pass.

        Args:
            x: ``(batch, D, H, W, in_channels)``, each of D, H, W a multiple of its axis's ``divisors``;
                cast to the layer's compute dtype.
            training: passed to the norms; also enables the ``set_recompute`` stages.

        Returns:
            Logits ``(batch, D, H, W, num_classes)`` (with ``region_outputs``: one per region,
            ``num_outputs``), float32 whatever the compute dtype (no softmax or sigmoid). With
            ``deep_supervision`` and ``training``, a list: those logits, then each
            supervised level's (``supervised_levels``, finest first: ``(batch, D/2, H/2, W/2,
            num_outputs)``, ...), nnU-Net's order.
        """
        skips = []
        for stage in self.encoder:
            x = self._run_stage(stage, x, training)
            skips.append(x)
        skips.pop()  # the bottleneck output is not a skip
        supervised = []
        for level, stage in zip(reversed(range(len(self.decoder))), self.decoder):
            x = self._run_stage(stage, [x, skips.pop()], training)
            if training and level in self.supervision_heads:
                supervised.append(self.to_float32(self.supervision_heads[level](x)))
        logits = self.to_float32(self.head(x))
        return [logits, *reversed(supervised)] if supervised else logits

    # ---- shapes and accounting -------------------------------------------------------------

    def check_spatial_shape(self, spatial_shape: Shape3D, *, field: str = "spatial shape") -> None:
        """Check the size contract: every spatial size a positive multiple of its axis's ``divisors``.

        Args:
            spatial_shape: ``(D, H, W)`` in voxels.
            field: what the message calls the size: a config field (``"data.volume"``, shown as
                its flag on the command line) or a plain name (default ``"spatial shape"``).

        Raises:
            ConfigError: a size is not a positive multiple of its axis's divisor (``2**depth`` by default);
                the message gives the nearest multiples to try.
        """
        if len(set(self.model_config.divisors)) > 1:  # name the axis and its own divisor
            check_shape(field, tuple(spatial_shape), self.model_config)
            return
        for size in spatial_shape:
            check_multiple(field, size, self.model_config)

    def block_feature_map_elements(self, spatial_shape: Shape3D) -> dict[str, int]:
        """Per-sample feature-map elements of each block, for the memory estimate.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.

        Returns:
            ``{stage name: elements}`` in forward order, then the head (its output and the
            float32 cast); elements, not bytes.

        Raises:
            UsageError: ``spatial_shape`` breaks the size contract.
        """
        self.check_spatial_shape(spatial_shape)
        counts: dict[str, int] = {}
        shapes = []
        shape = tuple(spatial_shape)
        for stage in self.encoder:
            counts[stage.name] = stage.feature_map_elements(shape)
            shape = stage.output_spatial_shape(shape)
            shapes.append(shape)
        shapes.pop()
        for stage in self.decoder:
            counts[stage.name] = stage.feature_map_elements(shape)
            shape = stage.output_spatial_shape(shape)
        counts[self.head.name] = 2 * self.model_config.num_outputs * _voxels(shape)  # head out, float32 cast
        scales = self.model_config.level_scales()
        for level in self.model_config.supervised_levels:  # each lower head's logits and their float32 cast
            counts[f"head{level}"] = 2 * self.model_config.num_outputs * _voxels(
                [s // f for s, f in zip(spatial_shape, scales[level])])
        return counts

    def forward_macs(self, spatial_shape: Shape3D) -> int:
        """Multiply-adds of one forward pass of one sample (convolutions; the 1x1x1 head included).

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.

        Returns:
            Multiply-adds (norms, activations and pooling are not counted).

        Raises:
            UsageError: ``spatial_shape`` breaks the size contract.
        """
        self.check_spatial_shape(spatial_shape)
        total, shape = 0, tuple(spatial_shape)
        for stage in self.encoder:
            total += stage.forward_macs(shape)
            shape = stage.output_spatial_shape(shape)
        for stage in self.decoder:
            total += stage.forward_macs(shape)
            shape = stage.output_spatial_shape(shape)
        cfg = self.model_config
        scales = cfg.level_scales()
        total += sum(cfg.filters[level] * cfg.num_outputs
                     * _voxels([s // f for s, f in zip(spatial_shape, scales[level])])
                     for level in cfg.supervised_levels)
        return total + cfg.filters[0] * cfg.num_outputs * _voxels(shape)

    def train_flops(self, spatial_shape: Shape3D, batch_size: int = 1) -> int:
        """FLOPs of one training step: 2 FLOPs per multiply-add, backward = 2x forward.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.
            batch_size: samples per step (default 1).

        Returns:
            ``6 * forward_macs(spatial_shape) * batch_size``.

        Raises:
            UsageError: ``spatial_shape`` breaks the size contract.
        """
        return 3 * 2 * self.forward_macs(spatial_shape) * batch_size

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """Per-sample feature-map elements of the whole network for one input shape.

        Args:
            spatial_shape: the input's ``(D, H, W)`` in voxels.

        Returns:
            The sum of ``block_feature_map_elements`` (elements, not bytes).

        Raises:
            UsageError: ``spatial_shape`` breaks the size contract.
        """
        return sum(self.block_feature_map_elements(spatial_shape).values())

    def build_for(self, spatial_shape: Sequence[int] | None = None) -> "UNet3D":
        """Create the weights if not yet built, without computing a tensor.

        Args:
            spatial_shape: ``(D, H, W)`` to trace with (default ``divisors``, ``2**depth`` on every axis); the
                weights of a fully convolutional net do not depend on it.

        Returns:
            ``self``, built.
        """
        if not self.built:
            shape = tuple(spatial_shape) if spatial_shape else self.model_config.divisors
            self.build((None, *shape, self.model_config.in_channels))
        return self

    def get_config(self):
        """Keras's config plus ``"config"``: the model fields as plain values (``recompute`` is not saved)."""
        config = super().get_config()
        config["config"] = {k: v for k, v in ExperimentConfig(model=self.model_config).to_dict()["model"].items()}
        return config

    @classmethod
    def from_config(cls, config):
        """The ``UNet3D`` that ``get_config`` describes (unbuilt)."""
        config = dict(config)
        return cls(config.pop("config"), **config)
