"""String options as enums, and one look-up that names the valid values on a miss.

As MONAI's ``look_up_option``: a wrong value gets the list of valid ones and, when one is
close, "did you mean ...?".
"""

from __future__ import annotations

import difflib
from enum import Enum
from typing import TypeVar

from bigmem.errors import UsageError


class StrOption(str, Enum):
    """An enum whose members are their own string values (JSON-serialisable as such)."""

    def __str__(self) -> str:
        return self.value


class Norm(StrOption):
    INSTANCE = "instance"
    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


class Activation(StrOption):
    RELU = "relu"
    LEAKY_RELU = "leaky_relu"


class Downsampling(StrOption):
    MAXPOOL = "maxpool"
    STRIDED = "strided"


class Precision(StrOption):
    FP32 = "fp32"
    BF16 = "bf16"


class Recompute(StrOption):
    NONE = "none"
    STAGES = "stages"
    AUTO = "auto"


class Strategy(StrOption):
    NONE = "none"  # the big-memory path: whole volumes in one process
    MIRRORED = "mirrored"  # data parallel on one host (GPUs, or simulated on CPU)
    MULTIWORKER = "multiworker"  # data parallel across hosts, configured by TF_CONFIG
    PER_NODE = "per_node"  # one multiworker worker per NUMA node of this host (distribute/pernode.py launches them)


class Augment(StrOption):
    AUTO = "auto"  # nnunet when training on a store, light on the embedded synthetic set
    NNUNET = "nnunet"  # nnU-Net v2's default training augmentation (data/transforms.py)
    LIGHT = "light"  # flips and a scale/shift of intensity
    SPATIAL = "spatial"  # nnunet's spatial part only: rotation, scaling, mirroring
    INTENSITY = "intensity"  # nnunet's intensity part only: noise, blur, brightness, contrast, low resolution, gamma
    NONE = "none"


class Recipe(StrOption):
    AUTO = "auto"  # augmented on a store, preset on the embedded synthetic set (config.presets._with_recipe)
    AUGMENTED = "augmented"  # the preset's optimiser and schedule, nnU-Net's augmentation and deep supervision
    NNUNET = "nnunet"  # nnU-Net v2's training recipe whole (config.presets.NNUNET_RECIPE)
    PRESET = "preset"  # the preset's own [train] settings and the augmentation data.augment names


class OptimizerName(StrOption):
    SGD = "sgd"
    ADAM = "adam"


E = TypeVar("E", bound=StrOption)


def suggest(value: str, choices: list[str]) -> str:
    """' Did you mean 'x'?' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def look_up_option(value: str | E, option: type[E], *, flag: str) -> E:
    """Return the member of ``option`` named by ``value`` or raise a UsageError naming the valid ones."""
    if isinstance(value, option):
        return value
    try:
        return option(str(value).strip().lower().replace("-", "_"))
    except ValueError:
        choices = [member.value for member in option]
        raise UsageError(
            f"Invalid {flag} {value!r}: expected one of {', '.join(choices)}."
            + suggest(str(value), choices)
        ) from None
