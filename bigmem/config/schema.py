"""Typed configuration: nested dataclasses resolved defaults -> preset file -> flags.

Every run saves the resolved result (``ExperimentConfig.to_dict``) as ``RUN_DIR/config.json``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from bigmem.config.options import (
    Activation,
    Downsampling,
    Norm,
    OptimizerName,
    Precision,
    Recompute,
    Strategy,
    StrOption,
    Upsampling,
    look_up_option,
    suggest,
)
from bigmem.errors import UsageError


@dataclass
class ModelConfig:
    """A 3D U-Net: ``depth`` downsamplings, filters doubling per level up to ``max_filters``."""

    name: str = "custom"
    depth: int = 4
    base_filters: int = 16
    max_filters: int = 320
    blocks_per_level: int = 2
    norm: Norm = Norm.INSTANCE
    groups: int = 8
    activation: Activation = Activation.RELU
    downsampling: Downsampling = Downsampling.MAXPOOL
    upsampling: Upsampling = Upsampling.TRANSPOSED
    residual: bool = False
    conv_bias: bool = False
    # True: only Keras's stock layers (Concatenate + Conv3D for skips, GroupNormalization, ReLU), as
    # a plain Keras model is written; the speed benchmark's baseline. False: bigmem's fused
    # norm+activation (nets/norm_act.py) and two-input skip convolutions (nets/blocks.py).
    stock_layers: bool = False
    in_channels: int = 1
    num_classes: int = 3

    @property
    def filters(self) -> list[int]:
        """Channels per level, from full resolution to the bottleneck."""
        return [min(self.base_filters * 2**level, self.max_filters) for level in range(self.depth + 1)]

    @property
    def divisor(self) -> int:
        """Every spatial size must be a multiple of this (the network halves it ``depth`` times)."""
        return 2**self.depth

    def validate(self) -> None:
        for name in ("depth", "base_filters", "max_filters", "blocks_per_level", "in_channels"):
            if getattr(self, name) < (0 if name == "depth" else 1):
                raise UsageError(f"Invalid model.{name} {getattr(self, name)}: expected a positive integer.")
        if self.num_classes < 2:
            raise UsageError(
                f"Invalid model.num_classes {self.num_classes}: expected >= 2 (background + at least one class)."
            )
        if self.norm is Norm.GROUP and any(f % self.groups for f in self.filters):
            raise UsageError(
                f"Invalid model.groups {self.groups}: every level's filters {self.filters} must be divisible by it."
            )


@dataclass
class DataConfig:
    """Where cases come from and how they are shaped for the network."""

    store: str | None = None  # --data; None: the embedded synthetic dataset
    volume: int = 48  # whole volumes are cropped/padded to volume^3
    prefetch: int = 2
    num_workers: int = 0  # 0: read in the training process; N: N reader processes
    flip: bool = True
    cold_cache: bool = False  # --cold-cache: drop the store's pages after each read (dataset > RAM)
    holdout: int = 0  # the last N cases (sorted ids) are kept out of training, for evaluation
    patch: int | None = None  # data-parallel path: patch edge (default: the largest that fits --gpu-memory)
    synth_cases: int = 16
    synth_volume: int = 48
    synth_classes: int = 3

    def validate(self) -> None:
        if self.volume < 1:
            raise UsageError(f"Invalid --volume {self.volume}: expected a positive integer.")
        if self.prefetch < 0 or self.num_workers < 0:
            raise UsageError("Invalid --prefetch/--num-workers: expected non-negative integers.")


@dataclass
class TrainConfig:
    """The optimisation recipe (DESIGN.md: Dice+CE, SGD Nesterov or Adam, warmup + poly decay)."""

    batch_size: int = 2
    steps: int | None = None
    epochs: int | None = None
    lr: float = 1e-3
    optimizer: OptimizerName = OptimizerName.ADAM
    momentum: float = 0.99  # nnU-Net's SGD momentum (Nesterov)
    warmup_steps: int = 20
    lr_decay_power: float = 2.0  # polynomial decay power (Goyal et al. style recipes use 2)
    end_lr: float = 0.0
    precision: Precision = Precision.FP32
    recompute: Recompute = Recompute.NONE  # stages: recompute every stage's activations in backward
    memory_budget_bytes: int | None = None  # --memory-budget; None: MemAvailable at start
    strategy: Strategy = Strategy.NONE  # --strategy: none (whole volumes) | mirrored | multiworker
    simulate_replicas: int | None = None  # --simulate-replicas N: N logical CPU devices instead of GPUs
    gpus: int | None = None  # --gpus N (default: every GPU found)
    gpu_memory_bytes: int | None = None  # --gpu-memory: per-GPU memory the patch must fit
    reference_batch: int | None = None  # --reference-batch: the global batch --lr is meant for
    time_budget_s: float | None = None  # --time-budget: stop (and save the model) after this much training
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    log_every: int = 1
    monitor_interval_s: float = 1.0  # --monitor-interval: seconds between monitor.csv rows; 0 turns it off

    def validate(self) -> None:
        if self.batch_size < 1:
            raise UsageError(f"Invalid --batch-size {self.batch_size}: expected a positive integer.")
        if self.steps is not None and self.epochs is not None:
            raise UsageError("Give either --steps or --epochs, not both.")
        for name in ("steps", "epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"Invalid --{name} {value}: expected a positive integer.")
        if not self.lr > 0:
            raise UsageError(f"Invalid --lr {self.lr}: expected a positive number.")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1 or self.log_every < 1:
            raise UsageError("Invalid checkpoint/log interval: expected positive integers.")
        if self.monitor_interval_s < 0:
            raise UsageError(f"Invalid --monitor-interval {self.monitor_interval_s:g}: expected seconds >= 0 "
                             "(0 turns the monitor off).")


@dataclass
class NUMAConfig:
    """Placement of memory and threads (bigmem/numa/policy.py has the forms)."""

    policy: str = "none"  # --numa
    cpus: str | None = None  # --cpus, e.g. 0-15,32-47
    threads: int | None = None  # --threads: TF intra-op threads (default: the CPUs used)


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    numa: NUMAConfig = field(default_factory=NUMAConfig)

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.train.validate()
        if self.data.volume % self.model.divisor:
            lower = max(self.model.divisor, self.data.volume // self.model.divisor * self.model.divisor)
            upper = lower + self.model.divisor
            raise UsageError(
                f"Invalid --volume {self.data.volume}: expected a multiple of {self.model.divisor} "
                f"(the network downsamples {self.model.depth} times). Try --volume {lower} or {upper}."
            )

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "ExperimentConfig":
        config = cls()
        update(config, values, source=source)
        return config


def to_dict(obj: Any) -> Any:
    """A dataclass as plain JSON-able data (enums become their string values)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, StrOption):
        return obj.value
    return obj


def update(obj: Any, values: Mapping[str, Any], *, source: str, prefix: str = "") -> None:
    """Overlay ``values`` onto dataclass ``obj`` in place, coercing and checking each value's type.

    ``source`` names where the values came from (a preset file, 'flags') for error messages.
    """
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise UsageError(
                f"Unknown setting {dotted!r} in {source}: expected one of {', '.join(names)}." + suggest(key, names)
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise UsageError(f"Invalid {dotted} in {source}: expected a table of settings.")
            update(current, value, source=source, prefix=f"{dotted}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted, source))


def _coerce(value: Any, hint: Any, dotted: str, source: str) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise UsageError(f"Invalid {dotted} in {source}: a value is required.")
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    flag = f"{dotted} ({source})" if source != "flags" else f"--{dotted.split('.')[-1].replace('_', '-')}"
    if isinstance(base, type) and issubclass(base, StrOption):
        return look_up_option(value, base, flag=flag)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"Invalid {flag} {value!r}: expected true or false.")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"Invalid {flag} {value!r}: expected an integer.")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"Invalid {flag} {value!r}: expected a number.")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise UsageError(f"Invalid {flag} {value!r}: expected a string.")
        return value
    raise TypeError(f"unsupported config field type {hint!r} for {dotted}")  # a bug in this module
