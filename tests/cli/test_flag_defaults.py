"""A flag that sets a config field defaults to None, so the config's default applies (decided once, in
config/schema.py or the preset) and a flag not given never overrides a preset's value.

Each flag of every subcommand is mapped to the field it sets by ``cli.common.flag_for`` read in reverse
over every field of ``ExperimentConfig`` (``--batch-size`` <-> ``train.batch_size``).
"""

from __future__ import annotations

import argparse
import dataclasses

from bigmem.cli.common import flag_for
from bigmem.cli.main import build_parser
from bigmem.config.schema import ExperimentConfig

# Flags named as a field they do not set (the name is the field's, the meaning another): not config-backed.
NOT_CONFIG_BACKED = {
    ("synth", "--seed"): "the phantoms' random seed (bigmem.data.synth), not train.seed",
}



def _fields_by_flag() -> dict[str, str]:
    """``{flag: "section.field"}`` for every field of every section of ``ExperimentConfig``."""
    by_flag: dict[str, list[str]] = {}
    for section in dataclasses.fields(ExperimentConfig):
        for field in dataclasses.fields(getattr(ExperimentConfig(), section.name)):
            name = f"{section.name}.{field.name}"
            by_flag.setdefault(flag_for(name), []).append(name)
    shared = {flag: names for flag, names in by_flag.items() if len(names) > 1}
    assert not shared, f"flags that would set two fields: {shared}"
    return {flag: names[0] for flag, names in by_flag.items()}


def _config_backed() -> list[tuple[str, str, str, object]]:
    """``(command, flag, field, default)`` for every flag of every subcommand that sets a config field."""
    fields = _fields_by_flag()
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, parser in subparsers.choices.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in fields and (command, flag) not in NOT_CONFIG_BACKED:
                    found.append((command, flag, fields[flag], action.default))
    return found


def _unset(default) -> bool:
    return default is None or default is argparse.SUPPRESS


def test_every_subcommand_is_checked():
    commands = {command for command, *_ in _config_backed()}
    assert {"train", "profile", "plan", "compare", "predict", "evaluate"} <= commands


def test_config_backed_flags_default_to_none():
    wrong = [f"bigmem {command} {flag} (sets {field}) defaults to {default!r}"
             for command, flag, field, default in _config_backed()
             if not _unset(default)]
    assert not wrong, "config-backed flags with a default of their own: " + "; ".join(wrong)


def test_the_exceptions_are_still_flags_of_their_commands():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, flag in NOT_CONFIG_BACKED:
        assert flag in subparsers.choices[command]._option_string_actions, f"bigmem {command} has no {flag}"
