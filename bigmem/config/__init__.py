"""Typed, layered configuration (defaults -> preset -> flags)."""

from bigmem.config.options import (
    Activation,
    Downsampling,
    Norm,
    OptimizerName,
    Precision,
    Recompute,
    look_up_option,
)
from bigmem.config.presets import load_preset, preset_names, resolve_config
from bigmem.config.schema import DataConfig, ExperimentConfig, ModelConfig, TrainConfig

__all__ = [
    "Activation", "DataConfig", "Downsampling", "ExperimentConfig", "ModelConfig", "Norm",
    "OptimizerName", "Precision", "Recompute", "TrainConfig", "load_preset", "look_up_option",
    "preset_names", "resolve_config",
]
