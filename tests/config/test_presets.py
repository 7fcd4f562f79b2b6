"""Presets and their resolution: defaults -> preset -> flags; preset files and old runs' configs."""

from __future__ import annotations

import pytest

from bigmem.config import ExperimentConfig, preset_names, resolve_config
from bigmem.cli.common import flag_for
from bigmem.errors import UsageError


def test_presets_ship_with_the_package():
    assert preset_names() == ["intelai-brats", "kits19", "resenc-m", "small", "tiny"]


def test_layering_order():
    defaults = ExperimentConfig()
    preset = resolve_config("small")
    assert preset.train.steps != defaults.train.steps  # the preset overrides a default
    assert preset.train.batch_size == 2
    flagged = resolve_config("small", {"train": {"batch_size": 4}, "data": {"volume": 64}})
    assert (flagged.train.batch_size, flagged.data.shape) == (4, (64, 64, 64))  # data.volume N: the cube N^3
    assert flagged.model.base_filters == preset.model.base_filters  # untouched by the flags
    assert flagged.model.name == "small"


def test_preset_from_a_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[model]\ndepth = 1\nbase_filters = 2\n[data]\nvolume = 6\n')
    config = resolve_config(str(path))
    assert (config.model.name, config.model.depth, config.data.shape) == ("mine", 1, (6, 6, 6))


@pytest.mark.parametrize("preset, overrides, message", [
    ("smal", None, "Unknown preset 'smal' (--model): expected one of intelai-brats, kits19, resenc-m, small, tiny or a "
                   "path to a .toml file. Did you mean 'small'?"),
    ("small", {"data": {"volume": 50}}, "Invalid --volume 50: expected a multiple of 8 (the network downsamples "
                                        "3 times). Try --volume 48 or 56."),
    ("kits19", {"data": {"volume": 100}}, "Invalid --volume 100: expected a multiple of 32 (the network "
                                          "downsamples 5 times). Try --volume 96 or 128."),
    ("small", {"data": {"shape": [240, 240, 155]}}, "Invalid --shape 240,240,155: axis 3 (155) is not a multiple of "
                                                    "8 (the network downsamples 3 times). Try --shape 240,240,152 or "
                                                    "240,240,160."),
    ("intelai-brats", {"data": {"shape": [250, 240, 144]}}, "Invalid --shape 250,240,144: axis 1 (250) is not a "
                                                            "multiple of 16 (the network downsamples 4 times). Try "
                                                            "--shape 240,240,144 or 256,240,144."),
    ("small", {"data": {"shape": [64, 64]}}, "Invalid --shape [64, 64]: expected 3 integers such as [240, 240, 144]."),
    ("small", {"data": {"pad_multiple": 12}}, "Invalid --pad-multiple 12: expected a multiple of 8 (the network "
                                              "downsamples 3 times). Try --pad-multiple 8 or 16."),
    ("small", {"model": {"norm": "instnce"}}, "Invalid --norm 'instnce': expected one of instance, group, batch, "
                                              "none. Did you mean 'instance'?"),
    ("small", {"train": {"optimizer": "adamw"}}, "Invalid --optimizer 'adamw': expected one of sgd, adam. Did you "
                                                 "mean 'adam'?"),
    ("small", {"train": {"steps": 3, "epochs": 1}}, "Give either --steps or --epochs, not both."),
    ("small", {"train": {"batch_size": 0}}, "Invalid --batch-size 0: expected a positive integer."),
    ("small", {"train": {"lr": -1.0}}, "Invalid --lr -1.0: expected a positive number."),
    ("small", {"train": {"batch_size": "2"}}, "Invalid --batch-size '2': expected an integer."),
    ("small", {"trian": {"lr": 1.0}}, "Unknown setting 'trian' in flags: expected one of model, data, train, "
                                      "memory, distribute, numa. Did you mean 'train'?"),
    ("small", {"distribute": {"patch": 0}}, "Invalid --patch 0: expected a positive integer."),
])
def test_resolution_errors(preset, overrides, message):
    """The messages as the command line prints them: each config field as its flag."""
    with pytest.raises(UsageError) as info:
        resolve_config(preset, overrides)
    shown = info.value.render(flag_for)  # as the command line shows it
    assert shown == message


def test_runs_saved_before_the_memory_and_distribute_sections_still_resolve():
    saved = {"train": {"recompute": "stages", "memory_budget_bytes": 2**30, "strategy": "mirrored", "gpus": 2},
             "data": {"patch": 32}}
    config = resolve_config("small", base=saved)
    assert (config.memory.recompute.value, config.memory.budget_bytes) == ("stages", 2**30)
    assert (config.distribute.strategy.value, config.distribute.gpus, config.distribute.patch) == ("mirrored", 2, 32)


def test_runs_saved_with_a_cube_volume_resume_at_that_cube():
    """config.json files from before shapes hold data.volume N: they resume at N^3, as they trained."""
    config = ExperimentConfig.from_dict({"data": {"volume": 48, "store": "x.h5"}, "model": {"depth": 3}})
    assert config.data.shape == (48, 48, 48)
    assert ExperimentConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["data"]["shape"] == [48, 48, 48]
    assert resolve_config("tiny").data.shape is None
    assert resolve_config("tiny").data.reference_volume == 16


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
