"""Model presets: TOML files in ``models/`` (packaged with the wheel as ``bigmem/models``).

A preset has a ``[card]`` table (description, reference) and ``[model]``, ``[data]``,
``[train]`` tables that overlay the dataclass defaults.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from bigmem.config.options import Recipe, suggest
from bigmem.config.schema import ExperimentConfig, migrate_sections, update
from bigmem.errors import UsageError

# nnU-Net v2's training recipe, whole, in config sections: laid over a preset where ``train.recipe`` resolves to
# nnunet (``resolve_config``), under the flags. Each value and its source line in nnunetv2 is a row of the parity
# table in docs/augmentation.md ("The recipe"): nnUNetTrainer.__init__ (initial_lr 1e-2, weight_decay 3e-5,
# enable_deep_supervision), configure_optimizers (SGD, momentum 0.99, nesterov), train_step (clip_grad_norm_ 12) and
# PolyLRScheduler (exponent 0.9, no warm-up), get_training_transforms (the augmentation).
NNUNET_RECIPE: dict[str, dict[str, Any]] = {
    "data": {"augment": "nnunet"},
    "model": {"deep_supervision": True},
    "train": {"optimizer": "sgd", "lr": 1e-2, "momentum": 0.99, "weight_decay": 3e-5, "clip_norm": 12.0,
              "lr_decay_power": 0.9, "warmup_steps": 0, "end_lr": 0.0},
}

# What --recipe auto trains on a store (the synthetic set keeps its preset's recipe): the preset's optimiser and
# schedule with nnU-Net's augmentation and deep supervision. The recipe study (benchmarks/proofs/bench_recipe_budget.py,
# benchmarks/results/recipe_budget.md) measured it well above nnU-Net's whole recipe on unseen subjects at 300 steps
# on both stand-ins (0.794 against 0.759, 0.842 against 0.386): nnU-Net's SGD schedule is made for 250,000
# iterations. Deep supervision, nnU-Net's, stays: without it the organs stand-in fell to 0.501 (brain: 0.795).
AUGMENTED_RECIPE: dict[str, dict[str, Any]] = {"data": {"augment": "nnunet"}, "model": {"deep_supervision": True}}

# The preset a command trains or sizes without --model: the demo network, which trains on the synthetic
# phantoms in minutes on a laptop-class machine (models/small.toml).
DEFAULT_PRESET = "small"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _preset_dir() -> Path:
    return Path(str(resources.files("bigmem") / "models"))


def preset_names() -> list[str]:
    """Names of the presets that ship with bigmem, sorted."""
    return sorted(p.stem for p in _preset_dir().glob("*.toml"))


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The parsed preset ``name`` (e.g. 'small'), or a TOML file given by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml" or not path.exists():
        path = _preset_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        names = preset_names()
        raise UsageError(
            f"Unknown preset {name_or_path!r} ({{model.name}}): expected one of {', '.join(names)} "
            "or a path to a .toml file." + suggest(name_or_path, names)
        )
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"Cannot read preset {path}: {exc}") from None


def resolve_config(
    preset: str | Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    base: Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """The one resolution of a config: defaults -> preset -> recipe -> ``base`` -> ``overrides``.

    The recipe (``train.recipe``, from the overrides, else ``base``, else the preset) resolves ``auto`` to
    augmented where the config trains on a store (``data.store``) and to preset on the synthetic set; nnunet
    lays ``NNUNET_RECIPE`` over the preset and augmented ``AUGMENTED_RECIPE``, so a flag still changes any one
    part. The resolved name is saved.

    Args:
        preset: a preset name ('small'), a path to a .toml file, or a preset's tables themselves (as
            ``data.experiment.Experiment.tables`` makes them; named by their ``model.name``, default "custom").
        overrides: settings by section from flags (``{"train": {"steps": 10}}``); errors name
            their fields (``ConfigError``), which the command line shows as flags.
        base: a saved config.json's sections, when resuming a run (settings from older
            layouts are moved to their sections).

    Returns:
        The validated, frozen ``ExperimentConfig``.

    Raises:
        UsageError: an unknown preset or setting, or a value bigmem cannot use.

    Example:
        >>> resolve_config("tiny", {"data": {"shape": [32, 32, 16]}}).data.shape
        (32, 32, 16)
    """
    if isinstance(preset, Mapping):
        values = {name: dict(table) if isinstance(table, Mapping) else table for name, table in preset.items()}
        source = "the configured preset"
    else:
        values, source = load_preset(preset), f"preset {preset!r}"
    values.pop("card", None)  # descriptive only; listed by models/README.md
    config = update(ExperimentConfig(), migrate_sections(values), source=source)
    if not isinstance(preset, Mapping):
        config = update(config, {"model": {"name": Path(preset).stem if preset.endswith(".toml") else preset}},
                        source="code")
    base = migrate_sections(base) if base else {}
    overrides = migrate_sections({k: v for k, v in overrides.items() if v}) if overrides else {}
    config = _with_recipe(config, base, overrides)
    if base:
        config = update(config, base, source="the saved config.json")
    if overrides:
        config = update(config, overrides, source="flags")
    config.validate()
    return config


def _with_recipe(config: ExperimentConfig, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> ExperimentConfig:
    """``config`` (a preset resolved) with its recipe resolved and, for nnunet, ``NNUNET_RECIPE`` laid over it.

    A saved config.json from before the recipe had a name (``base`` without ``train.recipe``) trained its
    preset's own settings, and resumes under them.
    """
    def given(section: str, key: str) -> tuple[Any, str]:
        for values, source in ((overrides, "flags"), (base, "the saved config.json")):
            if key in (values.get(section) or {}):
                return values[section][key], source
        return getattr(getattr(config, section), key), "code"

    if base and "recipe" not in (base.get("train") or {}):
        requested = Recipe.PRESET
    else:
        value, source = given("train", "recipe")
        requested = update(config, {"train": {"recipe": value}}, source=source).train.recipe
    if requested is Recipe.AUTO:
        requested = Recipe.AUGMENTED if given("data", "store")[0] else Recipe.PRESET
    if requested is Recipe.NNUNET:
        config = update(config, NNUNET_RECIPE, source="nnU-Net's recipe")
    if requested is Recipe.AUGMENTED:
        config = update(config, AUGMENTED_RECIPE, source="the augmented recipe")
    return update(config, {"train": {"recipe": requested.value}}, source="code")
