"""The typed, frozen configuration: round trips, field checks, messages that name the field and its flag."""

from __future__ import annotations

import dataclasses

import pytest

from bigmem.config import ExperimentConfig, Precision, resolve_config
from bigmem.cli.common import flag_for
from bigmem.errors import ConfigError, UsageError


def test_config_round_trips_through_dict():
    config = resolve_config("kits19", {"train": {"precision": "bf16"}})
    again = ExperimentConfig.from_dict(config.to_dict())
    assert again == config
    assert config.to_dict()["train"]["precision"] == "bf16"
    assert config.train.precision is Precision.BF16


def test_kits19_filters_are_capped():
    assert resolve_config("kits19").model.filters == [32, 64, 128, 256, 320, 320]
    assert resolve_config("intelai-brats").model.filters == [16, 32, 64, 128, 256]


def test_library_errors_name_config_fields():
    """A Python caller never typed a flag: the same errors name the fields it set."""
    with pytest.raises(ConfigError) as info:
        resolve_config("small", {"data": {"volume": 50}})
    assert info.value.field == "data.volume"
    assert str(info.value) == ("Invalid data.volume 50: expected a multiple of 8 (the network downsamples 3 times). "
                               "Try data.volume 48 or 56.")
    with pytest.raises(ConfigError) as info:
        resolve_config("small", {"data": {"shape": [48, 50, 48]}})
    assert info.value.field == "data.shape"
    assert str(info.value).startswith("Invalid data.shape 48,50,48: axis 2 (50) is not a multiple of 8 ")
    with pytest.raises(ConfigError, match=r"^Give either train.steps or train.epochs, not both\.$"):
        ExperimentConfig().updated({"train": {"steps": 3, "epochs": 1}}).validate()


@pytest.mark.parametrize("shape, message", [
    ((240, 240, 155), "axis 3 (155) is not a multiple of 8 (the network downsamples 3 times). Try {field} "
                      "240,240,152 or 240,240,160."),
    ((50, 50, 50), "axes 1, 2 and 3 (50, 50, 50) are not multiples of 8 (the network downsamples 3 times). Try "
                   "{field} 48,48,48 or 56,56,56."),
    ((48, 50, 60), "axes 2 and 3 (50, 60) are not multiples of 8 (the network downsamples 3 times). Try {field} "
                   "48,48,56 or 48,56,64."),
])
def test_a_bad_shape_suggests_shapes_that_fit(shape, message):
    from bigmem.config.schema import ModelConfig, check_shape

    with pytest.raises(ConfigError) as info:
        check_shape("data.shape", shape, ModelConfig(depth=3))
    assert info.value.template == f"Invalid {{field}} {','.join(map(str, shape))}: {message}"


@pytest.mark.parametrize("field, flag", [
    ("train.batch_size", "--batch-size"), ("data.volume", "--volume"), ("data.shape", "--shape"),
    ("data.pad_multiple", "--pad-multiple"), ("memory.budget_bytes", "--memory-budget"),
    ("distribute.gpu_memory_bytes", "--gpu-memory"), ("train.time_budget_s", "--time-budget"),
    ("train.monitor_interval_s", "--monitor-interval"), ("numa.policy", "--numa"), ("data.store", "--data"),
])
def test_every_field_has_its_flag(field, flag):
    assert flag_for(field) == flag


def test_config_is_frozen_and_copied():
    config = resolve_config("small")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data.shape = (64, 64, 64)  # type: ignore[misc]
    bigger = config.updated({"data": {"shape": [64, 64, 32]}})
    assert (config.data.shape, bigger.data.shape) == (None, (64, 64, 32))  # None: each case at its own shape
    assert bigger.model is config.model  # unchanged sections are shared, safely


def test_group_norm_needs_divisible_filters():
    with pytest.raises(UsageError, match=r"Invalid model.groups 3: every level's filters \[8, 16, 32, 64\]"):
        resolve_config("small", {"model": {"norm": "group", "groups": 3}})


def test_a_saved_config_from_before_augment_and_region_outputs_reads_as_it_trained():
    """config.json is complete: a setting it lacks is newer than the run, which trained with flips and the
    intensity scale/shift and with regions as softmax classes."""
    saved = ExperimentConfig().to_dict()
    del saved["data"]["augment"]
    del saved["model"]["region_outputs"]
    config = ExperimentConfig.from_dict(saved)
    assert config.data.augment.value == "light"
    assert config.model.region_outputs is False


def test_sections_of_leaves_out_the_records_beside_the_sections():
    saved = {**ExperimentConfig().to_dict(), "total_steps": 9, "augmentation": {"chain": "nnunet"}}
    assert sorted(ExperimentConfig.sections_of(saved)) == ["data", "distribute", "memory", "model", "numa", "train"]
