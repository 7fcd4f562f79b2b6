"""Typed configuration: nested frozen dataclasses resolved defaults -> preset file -> flags.

A config is resolved once and never changed: a different value is a new config
(``dataclasses.replace`` or ``ExperimentConfig.updated``). Every run saves the resolved result
(``ExperimentConfig.to_dict``) as ``RUN_DIR/config.json``.

Errors name config fields (``data.volume``), never flags: a Python caller never typed a flag.
``ConfigError`` carries the field, and the command line renders it as its flag
(``bigmem.cli.common.flag_for``): ``--volume``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from bigmem.config.options import (
    Activation,
    Augment,
    Downsampling,
    Norm,
    OptimizerName,
    Precision,
    Recipe,
    Recompute,
    Strategy,
    StrOption,
    look_up_option,
    suggest,
)
from bigmem.errors import ConfigError, UsageError


@dataclass(frozen=True)
class ModelConfig:
    """A 3D U-Net: ``depth`` downsamplings, filters doubling per level up to ``max_filters``.

    Attributes:
        name: the preset's name (set by ``resolve_config``).
        depth: downsamplings; every spatial size must be a multiple of ``2**depth`` (``divisor``).
        base_filters, max_filters: channels at full resolution, doubling per level up to the cap.
        blocks_per_level: blocks per stage (conv -> norm -> activation, or residual), where ``encoder_blocks`` or
            ``decoder_blocks`` does not say otherwise.
        norm, groups: instance, group (``groups`` per level), batch or none.
        activation, downsampling, residual, conv_bias: the block's parts (the decoder upsamples by
            transposed convolutions, kernel 2 = stride 2).
        stock_layers: build from Keras's stock layers only (the speed benchmark's baseline).
        deep_supervision: train the decoder's lower resolutions too, each through its own 1x1x1 head
            (nnU-Net's deep supervision and weights; ``train.losses.deep_supervision_weights``). Off in the
            presets, whose networks are published ones; inference uses the full resolution only.
        region_outputs: one sigmoid output per nnU-Net region (the store's ``regions``), trained with BCE +
            Dice and painted in ``regions_class_order`` (``train.region_loss``), instead of softmax classes.
            None (default): on where the store defines regions (``data.derived.with_data_fields``).
        in_channels, num_classes: filled from the store (``data.derived.with_data_fields``).
        kernel_sizes: each stage's convolution kernel per axis ``(D, H, W)``, full resolution first (``depth +
            1`` entries), as dynamic-network-architectures' ``PlainConvUNet`` takes them; None (default): 3x3x3
            everywhere. A kernel of 1 on an axis convolves each plane on its own (an anisotropic scan's coarse
            axis).
        strides: each stage's downsampling per axis, full resolution first (its entry is 1, 1, 1); the decoder
            upsamples by the same factors. None (default): 2x2x2 at every stage below the first.
        encoder_blocks: blocks per encoder stage, full resolution first, instead of ``blocks_per_level``; entries
            past stage ``depth`` are unused, as nnU-Net's planner takes the first ``n_stages`` of its (1, 3, 4, 6, 6,
            ...), so one list serves whatever depth a dataset's topology picks. None (default): ``blocks_per_level``.
        decoder_blocks: conv -> norm -> activation blocks per decoder stage, instead of ``blocks_per_level``
            (dynamic-network-architectures' ``n_conv_per_stage_decoder``, the same at every stage). None (default):
            ``blocks_per_level``.
        residual_encoder: nnU-Net's residual encoder (dynamic-network-architectures' ``ResidualEncoderUNet``): a
            stem (one conv -> norm -> activation into ``base_filters`` channels, the first stage's kernel), then
            residual blocks with ResNet-D shortcuts (``BasicBlockD``: average-pool by the stride, then a 1x1x1
            conv without bias + norm where the channels change) in every encoder stage; the decoder stays plain.
            Not with ``residual`` (bigmem's residual blocks in both halves).

    Example:
        >>> ModelConfig(depth=3).divisor, ModelConfig(base_filters=8, depth=2).filters
        (8, [8, 16, 32])
        >>> ModelConfig(depth=2, strides=((1, 1, 1), (1, 2, 2), (2, 2, 2))).divisors
        (2, 4, 4)
        >>> ModelConfig(depth=2, encoder_blocks=(1, 3, 4, 6, 6)).encoder_stage_blocks
        [1, 3, 4]
    """

    name: str = "custom"
    depth: int = 4
    base_filters: int = 16
    max_filters: int = 320
    blocks_per_level: int = 2
    norm: Norm = Norm.INSTANCE
    groups: int = 8
    activation: Activation = Activation.RELU
    downsampling: Downsampling = Downsampling.MAXPOOL
    residual: bool = False
    conv_bias: bool = False
    # True: only Keras's stock layers (Concatenate + Conv3D for skips, GroupNormalization, ReLU), as
    # a plain Keras model is written; the speed benchmark's baseline. False: bigmem's fused
    # norm+activation (nets/norm_act.py) and two-input skip convolutions (nets/blocks.py).
    stock_layers: bool = False
    deep_supervision: bool = False
    region_outputs: bool | None = None
    in_channels: int = 1
    num_classes: int = 3
    kernel_sizes: tuple[tuple[int, int, int], ...] | None = None
    strides: tuple[tuple[int, int, int], ...] | None = None
    encoder_blocks: tuple[int, ...] | None = None
    decoder_blocks: int | None = None
    residual_encoder: bool = False

    @property
    def encoder_stage_blocks(self) -> list[int]:
        """Blocks in each encoder stage, full resolution first: ``encoder_blocks``' first ``depth + 1``, else
        ``blocks_per_level``."""
        if self.encoder_blocks:
            return list(self.encoder_blocks[:self.depth + 1])
        return [self.blocks_per_level] * (self.depth + 1)

    @property
    def decoder_stage_blocks(self) -> int:
        """Blocks in every decoder stage: ``decoder_blocks``, else ``blocks_per_level``."""
        return self.blocks_per_level if self.decoder_blocks is None else self.decoder_blocks

    @property
    def stage_kernels(self) -> list[tuple[int, int, int]]:
        """Each stage's kernel per axis, full resolution first: ``kernel_sizes``, else 3x3x3."""
        return list(self.kernel_sizes) if self.kernel_sizes else [(3, 3, 3)] * (self.depth + 1)

    @property
    def stage_strides(self) -> list[tuple[int, int, int]]:
        """Each stage's downsampling per axis, full resolution first (1, 1, 1): ``strides``, else 2x2x2."""
        return list(self.strides) if self.strides else [(1, 1, 1)] + [(2, 2, 2)] * self.depth

    def level_scales(self) -> list[tuple[int, int, int]]:
        """Per level, how many full-resolution voxels one of its voxels spans on each axis (level 0: 1, 1, 1).

        Example:
            >>> ModelConfig(depth=2, strides=((1, 1, 1), (1, 2, 2), (2, 2, 2))).level_scales()
            [(1, 1, 1), (1, 2, 2), (2, 4, 4)]
        """
        scales, scale = [], (1, 1, 1)
        for stride in self.stage_strides:
            scale = tuple(a * b for a, b in zip(scale, stride))
            scales.append(scale)
        return scales

    @property
    def isotropic(self) -> bool:
        """Whether every stage has a cubic kernel and stride (the presets' networks)."""
        return all(len(set(k)) == 1 for k in self.stage_kernels) and all(len(set(s)) == 1 for s in self.stage_strides)

    @property
    def filters(self) -> list[int]:
        """Channels per level, from full resolution to the bottleneck."""
        return [min(self.base_filters * 2**level, self.max_filters) for level in range(self.depth + 1)]

    @property
    def num_outputs(self) -> int:
        """The network's output channels: ``num_classes``, or one per region (``num_classes - 1``: a region
        store's label values are background and one value each region is painted with)."""
        return self.num_classes - 1 if self.region_outputs else self.num_classes

    @property
    def supervised_levels(self) -> list[int]:
        """The decoder levels with a head of their own under ``deep_supervision``, finest first (level 0 is
        the main head). nnU-Net gives the lowest-resolution decoder output weight 0, so it gets no head.

        Example:
            >>> ModelConfig(depth=4, deep_supervision=True).supervised_levels
            [1, 2]
        """
        return list(range(1, self.depth - 1)) if self.deep_supervision else []

    @property
    def divisors(self) -> tuple[int, int, int]:
        """The size contract per axis ``(D, H, W)``: the product of that axis's strides (``2**depth`` by default)."""
        return self.level_scales()[-1]

    @property
    def divisor(self) -> int:
        """A cube edge that meets every axis's contract: the least common multiple of ``divisors`` (``2**depth``
        by default)."""
        return math.lcm(*self.divisors)

    def validate(self) -> None:
        for name in ("depth", "base_filters", "max_filters", "blocks_per_level", "in_channels"):
            if getattr(self, name) < (0 if name == "depth" else 1):
                raise ConfigError(f"model.{name}",
                                  f"Invalid {{field}} {getattr(self, name)}: expected a positive integer.")
        if self.num_classes < 2:
            raise ConfigError("model.num_classes", f"Invalid {{field}} {self.num_classes}: expected >= 2 "
                              "(background + at least one class).")
        for name in ("kernel_sizes", "strides"):
            value = getattr(self, name)
            if value is not None and len(value) != self.depth + 1:
                raise ConfigError(f"model.{name}", f"Invalid {{field}}: {len(value)} stages given, expected depth + 1 "
                                  f"= {self.depth + 1} (one per stage, full resolution first).")
            if value is not None and any(v < 1 for axes in value for v in axes):
                raise ConfigError(f"model.{name}", f"Invalid {{field}} {[list(v) for v in value]}: expected "
                                  "positive integers.")
        if self.kernel_sizes and any(k % 2 == 0 for axes in self.kernel_sizes for k in axes):
            raise ConfigError("model.kernel_sizes", "Invalid {field}: expected odd kernel sizes (\"same\" "
                              "convolutions centred on their voxel).")
        if self.strides and tuple(self.strides[0]) != (1, 1, 1):
            raise ConfigError("model.strides", f"Invalid {{field}}: the full-resolution stage's entry is "
                              f"{list(self.strides[0])}, expected [1, 1, 1].")
        if self.encoder_blocks is not None and len(self.encoder_blocks) < self.depth + 1:
            raise ConfigError("model.encoder_blocks", f"Invalid {{field}}: {len(self.encoder_blocks)} stages given, "
                              f"expected at least depth + 1 = {self.depth + 1} (one per stage, full resolution "
                              "first).")
        if self.encoder_blocks is not None and any(n < 1 for n in self.encoder_blocks):
            raise ConfigError("model.encoder_blocks", f"Invalid {{field}} {list(self.encoder_blocks)}: expected "
                              "positive integers.")
        if self.decoder_blocks is not None and self.decoder_blocks < 1:
            raise ConfigError("model.decoder_blocks", f"Invalid {{field}} {self.decoder_blocks}: expected a positive "
                              "integer.")
        if self.residual_encoder and self.residual:
            raise ConfigError("model.residual_encoder", "Give either {field} (nnU-Net's residual encoder, plain "
                              "decoder) or {model.residual} (residual blocks in both halves), not both.")
        if self.norm is Norm.GROUP and any(f % self.groups for f in self.filters):
            raise ConfigError("model.groups", f"Invalid {{field}} {self.groups}: every level's filters "
                              f"{self.filters} must be divisible by it.")


@dataclass(frozen=True)
class DataConfig:
    """Where cases come from and how they are shaped for the network.

    Attributes:
        store: the HDF5 store (``--data``); None: the embedded synthetic dataset.
        shape: ``(D, H, W)`` every case is cropped (at a random offset) or padded to for
            training (``--shape``, or ``--volume N`` for N^3); None (default): each case whole,
            at its own shape padded to a multiple of ``pad_multiple``.
        pad_multiple: with ``shape`` None, each axis is padded up to a multiple of this (default
            None: ``2**depth``, the size contract); a coarser multiple groups many shapes into
            fewer compiled steps (``--pad-multiple``).
        reference_volume: the cube edge ``bigmem profile`` and ``bigmem compare`` use when given
            neither a shape nor a store: the preset's reference size (kits19: MLPerf's 128^3).
        prefetch: batches prepared ahead of the step.
        num_workers: reader processes (0: read in the training process).
        augment: the training augmentation chain (``data/transforms.chain``): ``nnunet`` (nnU-Net v2's
            default: rotation, scaling, noise, blur, brightness, contrast, low resolution, gamma,
            mirroring), ``light`` (``flip`` and ``intensity_*``) or ``none``; ``auto`` (default):
            nnunet when training on a store, light on the embedded synthetic set (resolved by
            ``data.derived.with_data_fields`` and saved resolved). Validation and predict apply none.
        flip: the ``light`` chain mirrors each axis with probability 0.5.
        intensity_scale: the ``light`` chain multiplies each channel by U(1 - s, 1 + s) after
            normalisation (default 0.1; 0: off), as MONAI's RandScaleIntensity.
        intensity_shift: and shifts it by U(-t, t) standard deviations (default 0.1; 0: off), as
            MONAI's RandShiftIntensity.
        cold_cache: drop the store's pages after each read (a dataset larger than RAM).
        holdout: the last N cases (sorted ids) kept out of training, for validation.
        fold: nnU-Net v2's cross-validation fold to train ("0".."4"; ``data/splits.fold_split``): its train
            cases train, its val cases validate; "all": every case trains and validates (default None: off).
        splits: the ``splits_final.json`` whose folds ``fold`` picks (default None: one beside the store,
            else nnU-Net's 5 folds of the store's cases).
        synth_cases, synth_volume, synth_classes: the synthetic dataset's shape.

    Example:
        >>> DataConfig(shape=(240, 240, 144), holdout=2).shape
        (240, 240, 144)
    """

    store: str | None = None  # --data; None: the embedded synthetic dataset
    shape: tuple[int, int, int] | None = None  # None: each case at its own shape, padded (never cropped)
    pad_multiple: int | None = None  # None: 2**depth
    reference_volume: int = 48
    prefetch: int = 2
    num_workers: int = 0  # 0: read in the training process; N: N reader processes
    augment: Augment = Augment.AUTO
    flip: bool = True
    intensity_scale: float = 0.1
    intensity_shift: float = 0.1
    cold_cache: bool = False  # --cold-cache: drop the store's pages after each read (dataset > RAM)
    holdout: int = 0  # the last N cases (sorted ids) are kept out of training, for evaluation
    fold: str | None = None  # --fold: nnU-Net v2's fold "0".."4", or "all"
    splits: str | None = None  # --splits: nnU-Net's splits_final.json (default: beside the store, else made)
    synth_cases: int = 16
    synth_volume: int = 48
    synth_classes: int = 3

    def validate(self) -> None:
        if self.shape is not None and (len(self.shape) != 3 or min(self.shape) < 1):
            raise ConfigError("data.shape", f"Invalid {{field}} {_shape_text(self.shape)}: expected three positive "
                              "integers D,H,W.")
        for name in ("reference_volume", "synth_cases", "synth_volume"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}",
                                  f"Invalid {{field}} {getattr(self, name)}: expected a positive integer.")
        if self.pad_multiple is not None and self.pad_multiple < 1:
            raise ConfigError("data.pad_multiple", f"Invalid {{field}} {self.pad_multiple}: expected a positive "
                              "integer.")
        for name in ("intensity_scale", "intensity_shift"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"data.{name}", f"Invalid {{field}} {getattr(self, name)}: expected a number in "
                                  "[0, 1) (0: off).")
        for name in ("prefetch", "num_workers", "holdout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name}", f"Invalid {{field}} {getattr(self, name)}: expected an integer >= 0.")
        if self.fold is not None and self.fold != "all" and not (self.fold.isascii() and self.fold.isdigit()):
            raise ConfigError("data.fold", f"Invalid {{field}} {self.fold!r}: expected a fold number 0..4 (nnU-Net's "
                              "5-fold cross-validation; more with a {data.splits} file of more folds) or all.")
        if self.splits is not None and self.fold is None:
            raise ConfigError("data.splits", "{field} gives the folds of {data.fold}: give {data.fold} K too.")
        if self.fold is not None and self.holdout:
            raise ConfigError("data.holdout", "Give either {field} or {data.fold}, not both: a fold's val cases are "
                              "the ones held out.")
        if not 2 <= self.synth_classes <= 255:
            raise ConfigError("data.synth_classes", f"Invalid {{field}} {self.synth_classes}: expected 2..255 "
                              "(background + foreground classes).")


def _shape_text(shape) -> str:
    return ",".join(str(s) for s in shape)


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation recipe (Dice+CE, SGD Nesterov or Adam, warmup + poly decay).

    Attributes:
        recipe: the training recipe as one name: ``nnunet`` (nnU-Net v2's: its augmentation, deep
            supervision, SGD with Nesterov momentum 0.99 at lr 1e-2 with weight decay 3e-5, poly decay
            with exponent 0.9 and no warm-up; ``config.presets.NNUNET_RECIPE``), ``preset`` (the preset's own
            settings), ``augmented`` (the preset's optimiser and schedule with nnU-Net's augmentation and deep
            supervision; ``config.presets.AUGMENTED_RECIPE``) or ``auto`` (default: augmented on a store, preset on
            the embedded synthetic set). Resolved by ``config.presets.resolve_config``, under the flags, and
            saved resolved.
        batch_size: volumes per step (per replica when data-parallel).
        steps, epochs: the run's length (one of them; default one epoch).
        lr, optimizer, momentum, warmup_steps, lr_decay_power, end_lr: the schedule and update.
        weight_decay: L2 weight decay added to every gradient before the update (``g + weight_decay * w``, as
            PyTorch's SGD and Adam apply their ``weight_decay``; 0: off).
        clip_norm: scale the step's gradients down to this global L2 norm where it is larger (PyTorch's
            ``clip_grad_norm_``; nnU-Net clips to 12); None: no clipping.
        precision: fp32, or bf16 mixed precision (weights stay fp32).
        reference_batch: the global batch ``lr`` is meant for (data-parallel linear scaling).
        time_budget_s: stop (and save the model) after this many seconds of training.
        seed: weights, case order and augmentation.
        checkpoint_every, keep_checkpoints, log_every: the run directory's cadence.
        val_every: validate the held-out cases every K steps (0: off; needs ``data.holdout``).
        monitor_interval_s: seconds between monitor.csv rows (0: off).
        tune: on this machine's first run in a precision, run the tuning pass (``bigmem tune``) at the
            run's shape before planning; off, or ``BIGMEM_NO_TUNE=1``: the shipped tables.

    Example:
        >>> TrainConfig(steps=100, lr=1e-2).optimizer.value
        'adam'
    """

    recipe: Recipe = Recipe.AUTO
    batch_size: int = 2
    steps: int | None = None
    epochs: int | None = None
    lr: float = 1e-3
    optimizer: OptimizerName = OptimizerName.ADAM
    momentum: float = 0.99  # nnU-Net's SGD momentum (Nesterov)
    warmup_steps: int = 20
    lr_decay_power: float = 2.0  # polynomial decay power (Goyal et al. style recipes use 2)
    end_lr: float = 0.0
    weight_decay: float = 0.0
    clip_norm: float | None = None
    precision: Precision = Precision.FP32
    reference_batch: int | None = None  # the global batch ``lr`` is meant for (data-parallel lr scaling)
    time_budget_s: float | None = None  # --time-budget: stop (and save the model) after this much training
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    log_every: int = 1
    val_every: int = 0  # validate the held-out cases (data.holdout) every K steps and at the end; 0: off
    monitor_interval_s: float = 1.0  # --monitor-interval: seconds between monitor.csv rows; 0 turns it off
    tune: bool = True  # --no-tune: on first use of a precision, time this machine's kernel choices (bigmem tune)

    def validate(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("train.steps", "Give either {field} or {train.epochs}, not both.")
        for name in ("batch_size", "steps", "epochs", "checkpoint_every", "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"train.{name}", f"Invalid {{field}} {value}: expected a positive integer.")
        if self.val_every < 0:
            raise ConfigError("train.val_every", f"Invalid {{field}} {self.val_every}: expected steps >= 0 (0: off).")
        if self.warmup_steps < 0:
            raise ConfigError("train.warmup_steps", f"Invalid {{field}} {self.warmup_steps}: expected steps >= 0.")
        if self.reference_batch is not None and self.reference_batch < 1:
            raise ConfigError("train.reference_batch", f"Invalid {{field}} {self.reference_batch}: expected a positive "
                              "integer.")
        if not 0 < self.lr < math.inf:  # also refuses NaN, which compares false
            raise ConfigError("train.lr", f"Invalid {{field}} {self.lr}: expected a positive number.")
        if not 0 <= self.end_lr < math.inf:
            raise ConfigError("train.end_lr", f"Invalid {{field}} {self.end_lr}: expected a number >= 0.")
        if self.clip_norm is not None and not 0 < self.clip_norm < math.inf:
            raise ConfigError("train.clip_norm", f"Invalid {{field}} {self.clip_norm}: expected a positive number "
                              "(or none: no clipping).")
        if not 0 <= self.weight_decay < 1:
            raise ConfigError("train.weight_decay", f"Invalid {{field}} {self.weight_decay}: expected 0 <= "
                              "weight decay < 1 (0: off).")
        if not 0 <= self.momentum < 1:
            raise ConfigError("train.momentum", f"Invalid {{field}} {self.momentum}: expected 0 <= momentum < 1.")
        if not 0 < self.lr_decay_power < math.inf:
            raise ConfigError("train.lr_decay_power", f"Invalid {{field}} {self.lr_decay_power}: expected a positive "
                              "number.")
        if self.time_budget_s is not None and not 0 < self.time_budget_s < math.inf:
            raise ConfigError("train.time_budget_s", f"Invalid {{field}} {self.time_budget_s:g}: expected a positive, "
                              "finite number of seconds.")
        if not 0 <= self.monitor_interval_s < math.inf:
            raise ConfigError("train.monitor_interval_s", f"Invalid {{field}} {self.monitor_interval_s:g}: expected "
                              "seconds >= 0 (0 turns the monitor off).")


@dataclass(frozen=True)
class MemoryConfig:
    """How the job fits its memory (bigmem/memory/budget.py decides the budget from these).

    Attributes:
        budget_bytes: the most the predicted peak may be; None: what the NUMA placement can use,
            else MemAvailable at start (``memory.budget.resolve_budget``).
        recompute: none, stages (recompute every stage's activations in backward) or auto (the
            fewest stages that fit the budget).

    Example:
        >>> MemoryConfig(budget_bytes=2**40).recompute.value
        'none'
    """

    budget_bytes: int | None = None  # None: what the NUMA placement can use, else MemAvailable at start
    recompute: Recompute = Recompute.NONE  # stages: recompute every stage's activations in backward


@dataclass(frozen=True)
class DistributeConfig:
    """The data-parallel baseline (bigmem/distribute/): replicas, the patch that fits one GPU.

    With ``strategy`` none, training is single-process whole volumes; ``multiworker`` without
    ``gpu_memory_bytes`` or ``patch`` trains whole volumes on several CPU hosts.

    Attributes:
        strategy: none, mirrored (one host), multiworker (TF_CONFIG) or per_node (a launcher starting one
            multiworker worker per NUMA node, ``distribute/pernode``).
        simulate_replicas: N logical CPU devices instead of GPUs.
        gpus: GPUs to use (default: every one found).
        gpu_memory_bytes: the per-GPU memory the patch must fit.
        patch: the patch edge (default: the largest that fits ``gpu_memory_bytes``).

    Example:
        >>> DistributeConfig(strategy=Strategy.MIRRORED, gpu_memory_bytes=80 * 2**30).patch is None
        True
    """

    strategy: Strategy = Strategy.NONE  # none (whole volumes) | mirrored | multiworker | per_node
    simulate_replicas: int | None = None  # N logical CPU devices instead of GPUs
    gpus: int | None = None  # default: every GPU found
    gpu_memory_bytes: int | None = None  # per-GPU memory the patch must fit
    patch: int | None = None  # patch edge (default: the largest that fits gpu_memory_bytes)

    def validate(self) -> None:
        for name in ("simulate_replicas", "gpus", "gpu_memory_bytes", "patch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"distribute.{name}", f"Invalid {{field}} {value}: expected a positive integer.")


@dataclass(frozen=True)
class NUMAConfig:
    """Placement of memory and threads (bigmem/numa/policy.py has the forms).

    Attributes:
        policy: none, local, interleave[:NODES], bind:NODES or preferred:N (``--numa``).
        cpus: the CPUs to run on, e.g. '0-15,32-47' (default: the policy's nodes' CPUs).
        threads: TensorFlow's intra-op threads (default: the CPUs used).

    Example:
        >>> NUMAConfig(policy="interleave").threads is None
        True
    """

    policy: str = "none"  # --numa
    cpus: str | None = None  # --cpus, e.g. 0-15,32-47
    threads: int | None = None  # --threads: TF intra-op threads (default: the CPUs used)


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole job's settings, in sections; resolved once (``config.presets.resolve_config``) and frozen.

    Attributes:
        model, data, train, memory, distribute, numa: the sections (each documented above).

    Example:
        >>> config = ExperimentConfig().updated({"data": {"shape": [64, 64, 32]}}, source="code")
        >>> config.data.shape, config.to_dict()["memory"]["recompute"]
        ((64, 64, 32), 'none')
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    numa: NUMAConfig = field(default_factory=NUMAConfig)

    def validate(self) -> None:
        """Check every section and their agreement.

        Raises:
            ConfigError: a field with a value bigmem cannot use (it names the field).
        """
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.distribute.validate()
        if self.data.shape is not None and len(set(self.data.shape)) == 1:  # a cube: as its shorthand, --volume N
            check_multiple("data.volume", self.data.shape[0], self.model)
        elif self.data.shape is not None:
            check_shape("data.shape", self.data.shape, self.model)
        if self.data.pad_multiple is not None and self.data.pad_multiple % self.model.divisor:
            check_multiple("data.pad_multiple", self.data.pad_multiple, self.model)
        if self.distribute.patch is not None:  # a patch goes through the same network as a whole volume
            check_multiple("distribute.patch", self.distribute.patch, self.model)
        if self.train.val_every and not self.data.holdout and self.data.fold is None:
            raise ConfigError("train.val_every", "{field} needs held-out cases to validate on: give {data.holdout} N "
                              "(the last N cases are kept out of training) or {data.fold} K.")

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-able data (enums as their strings): config.json's sections."""
        return to_dict(self)

    def updated(self, values: Mapping[str, Any], *, source: str = "code") -> "ExperimentConfig":
        """A new config with ``values`` (nested by section, e.g. ``{"data": {"shape": [64, 64, 64]}}``) overlaid.

        ``data.volume`` N, the older cube-only setting, is read as ``data.shape`` (N, N, N).

        Example:
            >>> ExperimentConfig().updated({"train": {"batch_size": 1}}).train.batch_size
            1
        """
        return update(self, migrate_sections(values), source=source)

    @classmethod
    def sections_of(cls, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The settings of a saved config.json: its sections, without the records beside them (``total_steps``,
        ``effective_lr``, ``augmentation``, ...).

        Example:
            >>> ExperimentConfig.sections_of({"train": {"seed": 1}, "total_steps": 9, "augmentation": {}})
            {'train': {'seed': 1}}
        """
        names = {f.name for f in dataclasses.fields(cls)}
        sections = {k: dict(v) for k, v in saved.items() if k in names and isinstance(v, Mapping)}
        # A saved config.json is complete: a setting it lacks is newer than the run, which trained as before it.
        for dotted, before in SETTINGS_BEFORE_THEY_EXISTED.items():
            section, key = dotted.split(".")
            if section in sections and key not in sections[section]:
                sections[section][key] = before
        return sections

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "ExperimentConfig":
        """The config of ``values`` (config.json's sections) over the defaults.

        A run saved before ``data.augment`` existed trained with flips and the intensity scale/shift:
        it reads as ``light``; one saved before ``model.region_outputs``, with softmax classes.
        Settings saved by runs before the memory and distribute sections existed
        (``train.memory_budget_bytes``, ``train.recompute``, ``train.strategy``, ..., ``data.patch``)
        are read into their sections, and a cube ``data.volume`` N as ``data.shape`` (N, N, N), so
        older runs still resume at the shape they trained at.
        """
        return update(cls(), migrate_sections(cls.sections_of(values)), source=source)


# How a run saved before a setting existed trained: flips and the intensity scale/shift ("light"),
# and nnU-Net regions as softmax classes. ``ExperimentConfig.sections_of`` fills them into a saved config.
SETTINGS_BEFORE_THEY_EXISTED = {"data.augment": "light", "model.region_outputs": False}

# Settings that moved sections: old dotted name -> new (runs saved before the move still resume).
MOVED = {"train.memory_budget_bytes": "memory.budget_bytes", "train.recompute": "memory.recompute",
         **{f"train.{name}": f"distribute.{name}" for name in ("strategy", "simulate_replicas", "gpus",
                                                                "gpu_memory_bytes")},
         "data.patch": "distribute.patch"}


def migrate_sections(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with settings from before a section move put where they live now."""
    moved = {name: dict(section) if isinstance(section, Mapping) else section for name, section in values.items()}
    for old, new in MOVED.items():
        old_section, old_key = old.split(".")
        section = moved.get(old_section)
        if isinstance(section, Mapping) and old_key in section:
            new_section, new_key = new.split(".")
            moved.setdefault(new_section, {})[new_key] = section.pop(old_key)
    model = moved.get("model")
    # Configs from before the one upsampling was no longer a setting: "transposed" is what every network does.
    if isinstance(model, Mapping) and model.get("upsampling", "transposed") == "transposed":
        model.pop("upsampling", None)
    data = moved.get("data")
    # Runs and presets from before shapes: a cube. Such a run resumes at its cube and sample order; where
    # a case was smaller than the cube, its padding now takes the background value and the label that no
    # loss counts (it was 0 and background), so the steps after the resume differ there.
    if isinstance(data, Mapping) and "volume" in data:
        volume = data.pop("volume")
        if volume is not None and "shape" not in data:
            data["shape"] = [volume] * 3 if isinstance(volume, int) and not isinstance(volume, bool) else volume
    return moved


def check_multiple(field_name: str, size: int, model: ModelConfig) -> None:
    """Raise ``ConfigError`` naming ``field_name`` unless ``size`` is a positive multiple of ``model.divisor``."""
    divisor = model.divisor
    if size > 0 and size % divisor == 0:
        return
    lower = max(divisor, size // divisor * divisor)
    raise ConfigError(field_name, f"Invalid {{field}} {size}: expected a multiple of {divisor} (the network "
                      f"downsamples {model.depth} times). Try {{field}} {lower} or {lower + divisor}.")


def check_shape(field_name: str, shape, model: ModelConfig) -> None:
    """Raise ``ConfigError`` naming ``field_name`` and the axis unless every size is a multiple of its axis's
    ``model.divisors``.

    The two shapes it suggests round every axis that is not a multiple down and up, so both are valid.

    Example:
        >>> check_shape("data.shape", (240, 240, 155), ModelConfig())  # raises:
        ConfigError: Invalid {field} 240,240,155: axis 3 (155) is not a multiple of 16 ...
    """
    divisors = model.divisors
    bad = [(axis, size, d) for axis, (size, d) in enumerate(zip(shape, divisors), start=1)
           if not (size > 0 and size % d == 0)]
    if not bad:
        return
    lower = [max(d, size // d * d) for size, d in zip(shape, divisors)]
    tries = [tuple(size if size > 0 and size % d == 0 else low + step * d
                   for size, low, d in zip(shape, lower, divisors)) for step in (0, 1)]
    options = " or ".join(_shape_text(t) for t in dict.fromkeys(tries))
    of = str(bad[0][2]) if len({d for _, _, d in bad}) == 1 else f"{_shape_text(divisors)} (per axis)"
    if len(bad) == 1:
        what = f"axis {bad[0][0]} ({bad[0][1]}) is not a multiple"
    else:
        axes = ", ".join(str(axis) for axis, _, _ in bad[:-1]) + f" and {bad[-1][0]}"
        what = f"axes {axes} ({', '.join(str(size) for _, size, _ in bad)}) are not multiples"
    raise ConfigError(field_name, f"Invalid {{field}} {_shape_text(shape)}: {what} of {of} (the network "
                      f"downsamples {model.depth} times). Try {{field}} {options}.")


def to_dict(obj: Any) -> Any:
    """A dataclass as plain JSON-able data (enums become their string values)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, StrOption):
        return obj.value
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def update(obj: Any, values: Mapping[str, Any], *, source: str, prefix: str = "") -> Any:
    """A copy of dataclass ``obj`` with ``values`` overlaid, each value's type coerced and checked.

    Args:
        obj: a (frozen) config dataclass; it is not changed.
        values: settings by field name; a section's value is a mapping of its fields.
        source: where the values came from (a preset file, 'flags'), for error messages.
        prefix: the dotted name of ``obj`` ("data."), for error messages.

    Returns:
        The new dataclass (``dataclasses.replace``).

    Raises:
        UsageError: an unknown setting or a value of the wrong type; ``ConfigError`` (naming the
            field) when ``source`` is 'flags'.
    """
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    changes = {}
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
            changes[key] = update(current, value, source=source, prefix=f"{dotted}.")
        else:
            changes[key] = _coerce(value, hints[key], dotted, source)
    return dataclasses.replace(obj, **changes)


def _coerce(value: Any, hint: Any, dotted: str, source: str) -> Any:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else ()
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise UsageError(f"Invalid {dotted} in {source}: a value is required.")
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    named = source in ("flags", "code")  # else a file: name the setting and the file, not a flag
    name = "{field}" if named else f"{dotted} ({source})"

    def invalid(message: str) -> UsageError:
        return ConfigError(dotted, message) if named else UsageError(message)

    if isinstance(base, type) and issubclass(base, StrOption):
        try:
            return look_up_option(value, base, flag=name)
        except UsageError as exc:
            raise invalid(exc.template) from None
    if base is bool:
        if isinstance(value, bool):
            return value
        raise invalid(f"Invalid {name} {value!r}: expected true or false.")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"Invalid {name} {value!r}: expected an integer.")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"Invalid {name} {value!r}: expected a number.")
        return float(value)
    if typing.get_origin(base) is tuple and typing.get_args(base)[-1] is Ellipsis:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise invalid(f"Invalid {name} {value!r}: expected a list, one entry per stage.")
        return tuple(_coerce(v, typing.get_args(base)[0], dotted, source) for v in value)
    if typing.get_origin(base) is tuple:
        sizes = typing.get_args(base)
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != len(sizes) or any(
                isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise invalid(f"Invalid {name} {value!r}: expected {len(sizes)} integers such as [240, 240, 144].")
        return tuple(int(v) for v in value)
    if base is str:
        if not isinstance(value, str):
            raise invalid(f"Invalid {name} {value!r}: expected a string.")
        return value
    raise TypeError(f"unsupported config field type {hint!r} for {dotted}")  # a bug in this module
