"""Model presets: TOML files in ``models/`` (packaged with the wheel as ``bigmem/models``).

A preset has a ``[card]`` table (description, reference) and ``[model]``, ``[data]``,
``[train]`` tables that overlay the dataclass defaults.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from bigmem.config.options import suggest
from bigmem.config.schema import ExperimentConfig, migrate_sections, update
from bigmem.errors import UsageError

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
            f"Unknown preset {name_or_path!r} (--model): expected one of {', '.join(names)} "
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
    """The one resolution of a config: defaults -> preset -> ``base`` -> ``overrides``.

    Args:
        preset: a preset name ('small'), a path to a .toml file, or a preset's tables themselves (as
            ``memory.experiment.Experiment.tables`` makes them; named by their ``model.name``, default "custom").
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
    if base:
        config = update(config, migrate_sections(base), source="the saved config.json")
    if overrides:
        config = update(config, migrate_sections({k: v for k, v in overrides.items() if v}), source="flags")
    config.validate()
    return config
