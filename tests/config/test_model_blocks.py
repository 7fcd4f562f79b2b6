"""Per-stage block counts and the residual encoder in ``ModelConfig``; the resenc-m preset's settings."""

from __future__ import annotations

import pytest

from bigmem.cli.common import flag_for
from bigmem.config import ExperimentConfig, resolve_config
from bigmem.config.schema import ModelConfig
from bigmem.errors import ConfigError


def test_without_them_every_stage_has_blocks_per_level():
    config = ModelConfig(depth=3, blocks_per_level=2)
    assert config.encoder_stage_blocks == [2, 2, 2, 2]
    assert config.decoder_stage_blocks == 2
    assert config.residual_encoder is False


def test_a_longer_list_gives_its_first_depth_plus_one():
    """As nnU-Net's planner slices its (1, 3, 4, 6, 6, ...) to the stage count."""
    assert ModelConfig(depth=2, encoder_blocks=(1, 3, 4, 6, 6)).encoder_stage_blocks == [1, 3, 4]
    assert ModelConfig(depth=4, encoder_blocks=(1, 3, 4, 6, 6)).encoder_stage_blocks == [1, 3, 4, 6, 6]


@pytest.mark.parametrize("model, message", [
    ({"depth": 3, "encoder_blocks": [1, 3, 4]}, "Invalid --encoder-blocks: 3 stages given, expected at least depth + 1 "
                                                "= 4 (one per stage, full resolution first)."),
    ({"depth": 2, "encoder_blocks": [1, 0, 4]}, "Invalid --encoder-blocks [1, 0, 4]: expected positive integers."),
    ({"decoder_blocks": 0}, "Invalid --decoder-blocks 0: expected a positive integer."),
    ({"residual_encoder": True, "residual": True},
     "Give either --residual-encoder (nnU-Net's residual encoder, plain decoder) or --residual (residual blocks in "
     "both halves), not both."),
    ({"encoder_blocks": "1,3,4"}, "Invalid --encoder-blocks '1,3,4': expected a list, one entry per stage."),
])
def test_bad_block_settings_are_refused_naming_the_field(model, message):
    with pytest.raises(ConfigError) as info:
        resolve_config("tiny", {"model": model})
    assert info.value.render(flag_for) == message


def test_resenc_m_is_nnunets_3d_fullres_resenc():
    model = resolve_config("resenc-m").model
    assert model.filters == [32, 64, 128, 256, 320, 320]
    assert model.encoder_stage_blocks == [1, 3, 4, 6, 6, 6]
    assert model.decoder_stage_blocks == 1
    assert model.residual_encoder is True
    assert (model.norm.value, model.activation.value, model.downsampling.value) == ("instance", "leaky_relu",
                                                                                    "strided")
    assert model.conv_bias is True
    assert model.deep_supervision is True
    assert model.stage_kernels == [(3, 3, 3)] * 6
    assert model.stage_strides == [(1, 1, 1)] + [(2, 2, 2)] * 5


def test_resenc_m_trains_with_nnunets_sgd_recipe():
    train = resolve_config("resenc-m").train
    assert (train.optimizer.value, train.lr, train.momentum) == ("sgd", 1e-2, 0.99)
    assert train.lr_decay_power == 0.9
    assert train.warmup_steps == 0
    assert train.batch_size == 2


def test_resenc_m_follows_a_topologys_depth():
    """A topology of another depth (config/topology.py's [model] table) keeps nnU-Net's blocks per stage."""
    deeper = resolve_config("resenc-m", {"model": {"depth": 6, "kernel_sizes": [[1, 3, 3]] + [[3, 3, 3]] * 6,
                                                   "strides": [[1, 1, 1], [1, 2, 2]] + [[2, 2, 2]] * 5}}).model
    assert deeper.encoder_stage_blocks == [1, 3, 4, 6, 6, 6, 6]
    assert resolve_config("resenc-m", {"model": {"depth": 4}}).model.encoder_stage_blocks == [1, 3, 4, 6, 6]


def test_the_settings_round_trip_through_config_json():
    config = resolve_config("resenc-m")
    again = ExperimentConfig.from_dict(config.to_dict())
    assert again == config
    assert again.model.encoder_blocks == (1, 3, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6)


def test_a_run_saved_before_them_builds_the_same_network():
    saved = {"model": {"depth": 2, "base_filters": 4, "blocks_per_level": 1, "residual": True}}
    model = ExperimentConfig.from_dict(saved).model
    assert (model.encoder_blocks, model.decoder_blocks, model.residual_encoder) == (None, None, False)
    assert model.encoder_stage_blocks == [1, 1, 1]
