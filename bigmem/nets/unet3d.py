"""UNet3D: a Keras 3 3D U-Net built from a typed ``ModelConfig``."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import keras
import tensorflow as tf

from bigmem.config.schema import ExperimentConfig, ModelConfig, update
from bigmem.errors import UsageError
from bigmem.nets.conv import Conv3D
from bigmem.nets.blocks import DecoderStage, EncoderStage, Shape3D, _voxels


def _model_config(config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return dataclasses.replace(config)
    resolved = ExperimentConfig().model
    update(resolved, config, source="UNet3D config")
    resolved.validate()
    return resolved


@keras.saving.register_keras_serializable(package="bigmem")
class UNet3D(keras.Model):
    """3D U-Net on channels-last volumes ``(batch, D, H, W, C)``; returns float32 logits.

    ``depth`` encoder downsamplings (max pool or strided conv), mirrored by transposed-conv
    decoder stages with skip connections, and a 1x1x1 conv head with ``num_classes`` outputs.
    """

    def __init__(self, config: ModelConfig | Mapping[str, Any], **kwargs):
        super().__init__(**kwargs)
        self.model_config = _model_config(config)
        cfg = self.model_config
        common = dict(norm=cfg.norm.value, groups=cfg.groups, activation=cfg.activation.value,
                      use_bias=cfg.conv_bias, stock_layers=cfg.stock_layers, residual=cfg.residual,
                      num_blocks=cfg.blocks_per_level, dtype=self.dtype_policy)
        filters = cfg.filters
        self.encoder = [
            EncoderStage(filters[level], in_filters=filters[level - 1] if level else cfg.in_channels,
                         downsampling=cfg.downsampling.value if level else None, name=f"enc{level}", **common)
            for level in range(cfg.depth + 1)
        ]
        self.decoder = [
            DecoderStage(filters[level], in_filters=filters[level + 1], name=f"dec{level}", **common)
            for level in reversed(range(cfg.depth))
        ]
        head = keras.layers.Conv3D if cfg.stock_layers else Conv3D  # bigmem's runs in slabs past the limit
        self.head = head(cfg.num_classes, 1, dtype=self.dtype_policy, name="head")
        # Logits leave the network in float32 so the loss is computed in full precision.
        self.to_float32 = keras.layers.Activation("linear", dtype="float32", name="logits")
        # Names of the stages whose activations are recomputed in the backward pass instead of
        # kept (gradient checkpointing); a training-time choice, so not part of get_config.
        self.recompute: frozenset[str] = frozenset()

    @property
    def stage_names(self) -> list[str]:
        return [stage.name for stage in (*self.encoder, *self.decoder)]

    def set_recompute(self, stage_names) -> None:
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
        spatial = tuple(s or self.model_config.divisor for s in input_shape[1:-1])
        self.built = True  # before the trace: ``call`` must not re-enter build
        self.compute_output_spec(keras.KerasTensor((1, *spatial, input_shape[-1])))

    def call(self, x, training=None):
        skips = []
        for stage in self.encoder:
            x = self._run_stage(stage, x, training)
            skips.append(x)
        skips.pop()  # the bottleneck output is not a skip
        for stage in self.decoder:
            x = self._run_stage(stage, [x, skips.pop()], training)
        return self.to_float32(self.head(x))

    # ---- shapes and accounting -------------------------------------------------------------

    def check_spatial_shape(self, spatial_shape: Shape3D, *, flag: str = "--volume") -> None:
        """Raise a UsageError unless every spatial size is a multiple of 2**depth."""
        divisor = self.model_config.divisor
        bad = [s for s in spatial_shape if s % divisor or s <= 0]
        if bad:
            size = bad[0]
            lower = max(divisor, size // divisor * divisor)
            raise UsageError(
                f"Invalid {flag} {size}: expected a multiple of {divisor} "
                f"(the network downsamples {self.model_config.depth} times). "
                f"Try {flag} {lower} or {lower + divisor}."
            )

    def block_feature_map_elements(self, spatial_shape: Shape3D) -> dict[str, int]:
        """Per-sample feature-map elements of each block (in forward order) for one input shape."""
        self.check_spatial_shape(spatial_shape, flag="spatial shape")
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
        counts[self.head.name] = 2 * self.model_config.num_classes * _voxels(shape)  # head out, float32 cast
        return counts

    def forward_macs(self, spatial_shape: Shape3D) -> int:
        """Multiply-adds of one forward pass of one sample (convolutions; the 1x1x1 head included)."""
        self.check_spatial_shape(spatial_shape, flag="spatial shape")
        total, shape = 0, tuple(spatial_shape)
        for stage in self.encoder:
            total += stage.forward_macs(shape)
            shape = stage.output_spatial_shape(shape)
        for stage in self.decoder:
            total += stage.forward_macs(shape)
            shape = stage.output_spatial_shape(shape)
        return total + self.model_config.filters[0] * self.model_config.num_classes * _voxels(shape)

    def train_flops(self, spatial_shape: Shape3D, batch_size: int = 1) -> int:
        """FLOPs of one training step: 2 FLOPs per multiply-add, backward = 2x forward."""
        return 3 * 2 * self.forward_macs(spatial_shape) * batch_size

    def feature_map_elements(self, spatial_shape: Shape3D) -> int:
        """Per-sample feature-map elements of the whole network for one input shape."""
        return sum(self.block_feature_map_elements(spatial_shape).values())

    def build_for(self, spatial_shape: Sequence[int] | None = None) -> "UNet3D":
        """Create the weights (for a fully convolutional net the spatial size does not matter)."""
        if not self.built:
            shape = tuple(spatial_shape) if spatial_shape else (self.model_config.divisor,) * 3
            self.build((None, *shape, self.model_config.in_channels))
        return self

    def get_config(self):
        config = super().get_config()
        config["config"] = {k: v for k, v in ExperimentConfig(model=self.model_config).to_dict()["model"].items()}
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(config.pop("config"), **config)
