"""The training recipe as one name: nnU-Net's on a store, the preset's on the synthetic set, any part changeable."""

from __future__ import annotations

import pytest

from bigmem.config.presets import NNUNET_RECIPE, resolve_config
from bigmem.errors import ConfigError


def test_a_store_trains_the_augmented_recipe_by_default():
    config = resolve_config("small", {"data": {"store": "/data/store.h5"}})
    assert config.train.recipe.value == "augmented"


def test_the_augmented_recipe_keeps_the_presets_optimiser_with_nnunets_augmentation_and_deep_supervision():
    config = resolve_config("small", {"data": {"store": "/data/store.h5"}})
    assert (config.train.optimizer.value, config.train.lr, config.data.augment.value, config.model.deep_supervision) \
        == ("adam", 3e-3, "nnunet", True)


@pytest.mark.parametrize("field, value", [("optimizer", "sgd"), ("lr", 1e-2), ("momentum", 0.99),
                                          ("weight_decay", 3e-5), ("clip_norm", 12.0), ("lr_decay_power", 0.9),
                                          ("warmup_steps", 0)])
def test_nnunets_recipe_replaces_the_presets_optimiser(field, value):
    config = resolve_config("small", {"train": {"recipe": "nnunet"}})
    assert getattr(config.train, field) == value


def test_nnunets_recipe_turns_deep_supervision_and_its_augmentation_on():
    config = resolve_config("small", {"train": {"recipe": "nnunet"}})
    assert (config.model.deep_supervision, config.data.augment.value) == (True, "nnunet")


def test_the_synthetic_set_keeps_the_presets_recipe():
    config = resolve_config("small")
    assert (config.train.recipe.value, config.train.optimizer.value, config.train.lr) == ("preset", "adam", 3e-3)


def test_a_flag_changes_one_part_of_the_recipe():
    config = resolve_config("small", {"train": {"recipe": "nnunet", "weight_decay": 0.0},
                                      "model": {"deep_supervision": False}})
    assert (config.train.weight_decay, config.model.deep_supervision, config.train.lr) == (0.0, False, 1e-2)


def test_preset_recipe_on_a_store_keeps_the_presets_optimiser():
    config = resolve_config("small", {"data": {"store": "/s.h5"}, "train": {"recipe": "preset"}})
    assert (config.train.optimizer.value, config.train.weight_decay, config.model.deep_supervision) == \
        ("adam", 0.0, False)


def test_the_resolved_recipe_is_saved():
    config = resolve_config("small", {"data": {"store": "/s.h5"}})
    assert config.to_dict()["train"]["recipe"] == "augmented"


def test_a_saved_config_resumes_under_its_own_values():
    saved = resolve_config("small", {"data": {"store": "/s.h5"}, "train": {"lr": 5e-3}}).to_dict()
    again = resolve_config("small", base=saved)
    assert again.to_dict() == saved


def test_a_config_saved_before_recipes_had_names_resumes_under_its_preset():
    saved = resolve_config("small", {"data": {"store": "/s.h5"}, "train": {"recipe": "preset"}}).to_dict()
    del saved["train"]["recipe"]
    again = resolve_config("small", base=saved)
    assert (again.train.recipe.value, again.train.optimizer.value) == ("preset", "adam")


def test_an_unknown_recipe_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"Invalid train.recipe 'nnunte': expected one of auto, augmented, "
                                          r"nnunet, preset"):
        resolve_config("small", {"train": {"recipe": "nnunte"}})


def test_every_part_of_the_recipe_is_a_config_field():
    config = resolve_config("small")
    for section, values in NNUNET_RECIPE.items():
        for key in values:
            assert hasattr(getattr(config, section), key), f"{section}.{key}"


def test_the_run_opens_with_the_recipe_it_trains():
    from bigmem.train.trainer import _recipe_line

    config = resolve_config("small", {"data": {"store": "/s.h5"}, "train": {"recipe": "nnunet"}})
    assert _recipe_line(config) == ("Recipe nnunet: SGD (Nesterov, momentum 0.99) at lr 0.01, poly decay 0.9, weight "
                                    "decay 3e-05, gradients clipped to 12; augmentation nnunet; deep supervision on")
