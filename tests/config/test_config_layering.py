"""Configuration: defaults -> preset -> flags; enums with suggestions; pinned messages."""

from __future__ import annotations

import pytest

from bigmem.config import (
    ExperimentConfig, Norm, OptimizerName, Precision, look_up_option, preset_names, resolve_config,
)
from bigmem.errors import UsageError


def test_presets_ship_with_the_package():
    assert preset_names() == ["intelai-brats", "kits19", "small", "tiny"]


def test_layering_order():
    defaults = ExperimentConfig()
    preset = resolve_config("small")
    assert preset.train.steps != defaults.train.steps  # the preset overrides a default
    assert preset.train.batch_size == 2
    flagged = resolve_config("small", {"train": {"batch_size": 4}, "data": {"volume": 64}})
    assert (flagged.train.batch_size, flagged.data.volume) == (4, 64)
    assert flagged.model.base_filters == preset.model.base_filters  # untouched by the flags
    assert flagged.model.name == "small"


def test_config_round_trips_through_dict():
    config = resolve_config("kits19", {"train": {"precision": "bf16"}})
    again = ExperimentConfig.from_dict(config.to_dict())
    assert again == config
    assert config.to_dict()["train"]["precision"] == "bf16"
    assert config.train.precision is Precision.BF16


def test_kits19_filters_are_capped():
    assert resolve_config("kits19").model.filters == [32, 64, 128, 256, 320, 320]
    assert resolve_config("intelai-brats").model.filters == [16, 32, 64, 128, 256]


def test_preset_from_a_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[model]\ndepth = 1\nbase_filters = 2\n[data]\nvolume = 6\n')
    config = resolve_config(str(path))
    assert (config.model.name, config.model.depth, config.data.volume) == ("mine", 1, 6)


@pytest.mark.parametrize("preset, overrides, message", [
    ("smal", None, "Unknown preset 'smal' (--model): expected one of intelai-brats, kits19, small, tiny or a "
                   "path to a .toml file. Did you mean 'small'?"),
    ("small", {"data": {"volume": 50}}, "Invalid --volume 50: expected a multiple of 8 (the network downsamples "
                                        "3 times). Try --volume 48 or 56."),
    ("kits19", {"data": {"volume": 100}}, "Invalid --volume 100: expected a multiple of 32 (the network "
                                          "downsamples 5 times). Try --volume 96 or 128."),
    ("small", {"model": {"norm": "instnce"}}, "Invalid --norm 'instnce': expected one of instance, group, batch, "
                                              "none. Did you mean 'instance'?"),
    ("small", {"train": {"optimizer": "adamw"}}, "Invalid --optimizer 'adamw': expected one of sgd, adam. Did you "
                                                 "mean 'adam'?"),
    ("small", {"train": {"steps": 3, "epochs": 1}}, "Give either --steps or --epochs, not both."),
    ("small", {"train": {"batch_size": 0}}, "Invalid --batch-size 0: expected a positive integer."),
    ("small", {"train": {"lr": -1.0}}, "Invalid --lr -1.0: expected a positive number."),
    ("small", {"train": {"batch_size": "2"}}, "Invalid --batch-size '2': expected an integer."),
    ("small", {"trian": {"lr": 1.0}}, "Unknown setting 'trian' in flags: expected one of model, data, train, numa. "
                                      "Did you mean 'train'?"),
])
def test_resolution_errors(preset, overrides, message):
    with pytest.raises(UsageError) as info:
        resolve_config(preset, overrides)
    assert str(info.value) == message


def test_bad_preset_file_names_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\ndepht = 3\n')
    with pytest.raises(UsageError, match=r"Unknown setting 'model.depht' in preset .*Did you mean 'depth'\?"):
        resolve_config(str(path))


def test_unparseable_preset_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('[model\n')
    with pytest.raises(UsageError, match=r"^Cannot read preset .*broken.toml"):
        resolve_config(str(path))


def test_group_norm_needs_divisible_filters():
    with pytest.raises(UsageError, match=r"Invalid model.groups 3: every level's filters \[8, 16, 32, 64\]"):
        resolve_config("small", {"model": {"norm": "group", "groups": 3}})


def test_look_up_option_accepts_dashes_and_case():
    assert look_up_option("Instance", Norm, flag="--norm") is Norm.INSTANCE
    assert look_up_option("SGD", OptimizerName, flag="--optimizer") is OptimizerName.SGD
