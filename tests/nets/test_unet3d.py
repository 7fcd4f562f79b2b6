"""UNet3D: published parameter counts, shapes, serialisation, per-block accounting."""

from __future__ import annotations

import dataclasses

import math

import keras
import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.cli.common import flag_for
from bigmem.errors import ConfigError
from bigmem.nets.blocks import ConvNormAct, DecoderStage, EncoderStage, ResidualBlock
from bigmem.nets.unet3d import UNet3D

# Published sizes: IntelAI/unet 3D README (~5.65 M), MLPerf Training 3D U-Net (~31.2 M).
PUBLISHED_PARAMS = {"intelai-brats": 5.65e6, "kits19": 31.2e6}


def tiny_model(**model_overrides) -> UNet3D:
    return UNet3D(resolve_config("tiny", {"model": model_overrides}).model)


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_reference_presets_match_published_parameter_counts(preset):
    model = UNet3D(resolve_config(preset).model).build_for((32, 32, 32))
    params = model.count_params()
    assert abs(params - PUBLISHED_PARAMS[preset]) / PUBLISHED_PARAMS[preset] < 0.005, params
    x = np.zeros((1, 32, 32, 32, 1), np.float32)
    assert model(x).shape == (1, 32, 32, 32, model.model_config.num_classes)


def test_exact_counts_are_stable():
    # 5,650,818 = IntelAI's 5,650,801 with a 2-class softmax head instead of 1 sigmoid output.
    assert UNet3D(resolve_config("intelai-brats").model).build_for().count_params() == 5_650_818
    assert UNet3D(resolve_config("kits19").model).build_for().count_params() == 31_190_243


# A KiTS-like anisotropic network, as the experiment planner configures one (config/topology.py): the coarse
# depth axis is convolved plane by plane at full resolution and pooled one stage later than the others.
ANISOTROPIC = {"kernel_sizes": [[1, 3, 3], [3, 3, 3], [3, 3, 3]], "strides": [[1, 1, 1], [1, 2, 2], [2, 2, 2]]}

VARIANTS = [
    {},
    ANISOTROPIC,
    {"norm": "batch", "activation": "leaky_relu"},
    {"norm": "group", "groups": 2, "downsampling": "strided"},
    {"norm": "none", "conv_bias": True},
    {"residual": True, "blocks_per_level": 2},
    {"residual": True, "downsampling": "strided", "norm": "batch"},
    {**ANISOTROPIC, "residual": True, "downsampling": "strided"},
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "tiny")
@pytest.mark.parametrize("shape", [(16, 16, 16), (4, 12, 20)])
def test_output_shape_and_dtype(overrides, shape):
    model = tiny_model(**overrides)
    x = np.random.default_rng(0).normal(size=(2, *shape, 1)).astype(np.float32)
    y = model(x, training=False)
    assert y.shape == (2, *shape, 3)
    assert y.dtype == "float32"
    assert np.all(np.isfinite(np.asarray(y)))


@pytest.mark.parametrize("size", [33, 34, 35, 2])
def test_odd_sizes_are_refused_with_a_suggestion(size):
    model = tiny_model()
    with pytest.raises(ConfigError) as info:
        model.check_spatial_shape((size, 16, 16), field="data.volume")
    lower = max(4, size // 4 * 4)
    assert str(info.value) == (f"Invalid data.volume {size}: expected a multiple of 4 (the network downsamples 2 "
                               f"times). Try data.volume {lower} or {lower + 4}.")
    assert info.value.render(flag_for).startswith(f"Invalid --volume {size}: ")  # as the command line shows it
    with pytest.raises(ConfigError, match=rf"^Invalid spatial shape {size}: "):
        model.check_spatial_shape((16, 16, size))


@pytest.mark.parametrize("overrides", VARIANTS[:5], ids=str)
def test_get_config_round_trip(overrides):
    model = tiny_model(**overrides).build_for()
    clone = UNet3D.from_config(model.get_config()).build_for()
    clone.set_weights(model.get_weights())
    x = np.random.default_rng(1).normal(size=(1, 8, 8, 8, 1)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(clone(x)))
    assert clone.model_config == model.model_config


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("overrides", [{"residual": True, "norm": "batch"}, {"base_filters": 16},
                                       {**ANISOTROPIC, "base_filters": 16, "downsampling": "strided"}], ids=str)
def test_keras_file_round_trip(tmp_path, dtype, overrides):
    """Residual batch-norm blocks; and two-input skip convolutions with the fused instance norm."""
    model = UNet3D(resolve_config("tiny", {"model": overrides}).model, dtype=dtype)
    model.build_for()
    x = np.random.default_rng(2).normal(size=(1, 8, 8, 8, 1)).astype(np.float32)
    expected = np.asarray(model(x))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, UNet3D)
    assert loaded.dtype_policy.name == dtype
    np.testing.assert_array_equal(np.asarray(loaded(x)), expected)


def test_blocks_round_trip_their_config():
    for block in (ConvNormAct(4, strides=2, norm="group", groups=2, activation="leaky_relu", use_bias=True),
                  ResidualBlock(4, in_filters=2, strides=2),
                  EncoderStage(4, in_filters=2, downsampling="maxpool", residual=True),
                  DecoderStage(4, in_filters=8, num_blocks=1), DecoderStage(16, in_filters=32, num_blocks=1),
                  ConvNormAct(16, num_inputs=2, stock_layers=True)):
        again = type(block).from_config(block.get_config())
        assert again.get_config() == block.get_config()


def test_residual_blocks_start_with_zero_last_norm_scale():
    model = tiny_model(residual=True).build_for()
    block = model.encoder[0].blocks[0]
    assert isinstance(block, ResidualBlock)
    np.testing.assert_array_equal(np.asarray(block.norm_layer.gamma), 0.0)
    np.testing.assert_array_equal(np.asarray(block.first.norm_layer.gamma), 1.0)


def _size(t) -> int:
    return int(math.prod(t.shape[1:]))


def test_conv_norm_act_counts_its_tensors():
    fused = ConvNormAct(6, strides=2)  # instance norm + ReLU in one layer: conv out, norm-act out
    x = np.zeros((1, 8, 10, 12, 3), np.float32)
    conv = fused.conv(x)
    out = fused.norm_layer(conv)
    assert fused.act is None
    assert fused.feature_map_elements((8, 10, 12)) == _size(conv) + _size(out) == 2 * 6 * 4 * 5 * 6
    batch = ConvNormAct(6, strides=2, norm="batch")  # conv out, norm out, activation out
    conv = batch.conv(x)
    norm = batch.norm_layer(conv)
    act = batch.act(norm)
    assert batch.feature_map_elements((8, 10, 12)) == _size(conv) + _size(norm) + _size(act) == 3 * 6 * 4 * 5 * 6


def test_residual_block_counts_its_tensors():
    block = ResidualBlock(6, in_filters=3, strides=2)
    x = np.zeros((1, 8, 8, 8, 3), np.float32)
    first_out = block.first(x)
    conv = block.conv(first_out)
    norm = block.norm_layer(conv)
    proj = block.proj(x)
    proj_norm = block.proj_norm(proj)
    add = block.add([norm, proj_norm])
    act = block.act(add)
    expected = block.first.feature_map_elements((8, 8, 8)) + sum(map(_size, (conv, norm, proj, proj_norm, add, act)))
    assert block.feature_map_elements((8, 8, 8)) == expected


def test_encoder_and_decoder_stages_count_their_tensors():
    enc = EncoderStage(4, in_filters=2, downsampling="maxpool", num_blocks=2)
    x = np.zeros((1, 8, 8, 8, 2), np.float32)
    pooled = enc.pool(x)
    first = enc.blocks[0](pooled)
    assert enc.feature_map_elements((8, 8, 8)) == (_size(pooled) + enc.blocks[0].feature_map_elements((4, 4, 4))
                                                   + enc.blocks[1].feature_map_elements((4, 4, 4)))
    assert first.shape == (1, 4, 4, 4, 4)
    low = np.zeros((1, 4, 4, 4, 32), np.float32)
    skip = np.zeros((1, 8, 8, 8, 16), np.float32)
    # Plain blocks of 16 or more filters take [up, skip] as two inputs: no concatenated tensor.
    dec = DecoderStage(16, in_filters=32, num_blocks=1)
    assert dec.concat is None
    assert dec.blocks[0].num_inputs == 2
    up = dec.up(low)
    block = dec.blocks[0]
    parts = (block.conv(up), block.conv_skip(skip))
    summed = parts[0] + parts[1]
    assert block.feature_map_elements((8,) * 3) == sum(map(_size, (*parts, summed, block.norm_layer(summed))))
    assert dec.feature_map_elements((4, 4, 4)) == _size(up) + block.feature_map_elements((8,) * 3)
    # Residual blocks, and narrower levels, take the concatenation.
    for dec in (DecoderStage(16, in_filters=32, num_blocks=1, residual=True), DecoderStage(8, in_filters=32,
                                                                                             num_blocks=1)):
        up = dec.up(low)
        cat = dec.concat([up, skip[..., :dec.filters]])
        assert dec.feature_map_elements((4, 4, 4)) == (_size(up) + _size(cat)
                                                       + dec.blocks[0].feature_map_elements((8,) * 3))


@pytest.mark.parametrize("use_bias", [False, True])
def test_two_input_conv_is_a_conv_of_the_concatenation(use_bias):
    """conv(x) + conv_skip(skip) == one convolution of concat([x, skip]) with the kernels stacked."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6, 5, 7, 3)).astype(np.float32)
    skip = rng.normal(size=(2, 6, 5, 7, 2)).astype(np.float32)
    block = ConvNormAct(4, num_inputs=2, norm="none", use_bias=use_bias)
    got = np.asarray(block([x, skip]))
    whole = keras.layers.Conv3D(4, 3, padding="same", use_bias=use_bias)
    whole.build((None, 6, 5, 7, 5))
    stacked = np.concatenate([np.asarray(block.conv.kernel), np.asarray(block.conv_skip.kernel)], axis=3)
    whole.set_weights([stacked, np.asarray(block.conv.bias)] if use_bias else [stacked])
    want = np.asarray(keras.layers.ReLU()(whole(np.concatenate([x, skip], axis=-1))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_model_sums_its_blocks():
    model = tiny_model().build_for()
    per_block = model.block_feature_map_elements((16, 16, 16))
    assert list(per_block) == ["enc0", "enc1", "enc2", "dec1", "dec0", "head"]
    assert model.feature_map_elements((16, 16, 16)) == sum(per_block.values())
    # Doubling every edge multiplies every block's count by 8.
    doubled = model.block_feature_map_elements((32, 32, 32))
    assert all(doubled[name] == 8 * count for name, count in per_block.items())


def test_anisotropic_stages_pool_and_convolve_per_axis():
    model = tiny_model(**ANISOTROPIC).build_for()
    assert model.model_config.divisors == (2, 4, 4)
    assert model.encoder[0].blocks[0].conv.kernel.shape == (1, 3, 3, 1, 4)  # no depth tap at full resolution
    assert model.encoder[1].pool.pool_size == (1, 2, 2)
    assert model.decoder[-1].up.kernel.shape == (1, 2, 2, 4, 8)  # dec0 undoes enc1's pooling
    assert model(np.zeros((1, 6, 12, 8, 1), np.float32)).shape == (1, 6, 12, 8, 3)


def test_anisotropic_deep_supervision_heads_take_each_levels_shape():
    deeper = {"depth": 3, "kernel_sizes": ANISOTROPIC["kernel_sizes"] + [[3, 3, 3]],
              "strides": ANISOTROPIC["strides"] + [[2, 2, 2]]}
    model = tiny_model(**deeper, deep_supervision=True).build_for()
    x = np.zeros((1, 4, 16, 8, 1), np.float32)
    assert [tuple(y.shape) for y in model(x, training=True)] == [(1, 4, 16, 8, 3), (1, 4, 8, 4, 3)]
    assert model.block_feature_map_elements((4, 16, 8))["head1"] == 2 * 3 * 4 * 8 * 4


def test_anisotropic_blocks_count_per_axis():
    """The per-axis network's tensors: halving depth changes only the stages that keep it."""
    model = tiny_model(**ANISOTROPIC).build_for()
    counts = model.block_feature_map_elements((8, 16, 16))
    # enc1 pools (1, 2, 2): one pooled tensor of 4 channels and one conv + norm block of 8, at 8 x 8 x 8.
    assert counts["enc1"] == (4 + 2 * 8) * 8 * 8 * 8
    # enc2 pools (2, 2, 2) from there: 8 channels pooled, 16-channel block, at 4 x 4 x 4.
    assert counts["enc2"] == (8 + 2 * 16) * 4 * 4 * 4
    assert model.forward_macs((8, 16, 16)) == (
        9 * 1 * 4 * 2048 + 27 * 4 * 8 * 512 + 27 * 8 * 16 * 64  # enc0 (1x3x3), enc1, enc2
        + 16 * 8 * 512 + 27 * 16 * 8 * 512  # dec1: up (2, 2, 2), conv of [up, skip]
        + 8 * 4 * 2048 + 9 * 8 * 4 * 2048  # dec0: up (1, 2, 2), 1x3x3 conv of [up, skip]
        + 4 * 3 * 2048)  # the head


def test_anisotropic_sizes_are_refused_per_axis():
    with pytest.raises(ConfigError, match=r"^Invalid spatial shape 3,16,16: axis 1 \(3\) is not a multiple of 2 .* "
                                          r"Try spatial shape 2,16,16 or 4,16,16\."):
        tiny_model(**ANISOTROPIC).check_spatial_shape((3, 16, 16))


@pytest.mark.parametrize("field,value,message", [
    ("strides", [[1, 1, 1], [2, 2, 2]], "2 stages given, expected depth \\+ 1 = 3"),
    ("strides", [[2, 2, 2], [2, 2, 2], [2, 2, 2]], "full-resolution stage's entry is \\[2, 2, 2\\]"),
    ("kernel_sizes", [[3, 3, 3], [2, 3, 3], [3, 3, 3]], "expected odd kernel sizes"),
    ("kernel_sizes", [[3, 3], [3, 3, 3], [3, 3, 3]], "expected 3 integers"),
])
def test_per_axis_settings_are_checked(field, value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config("tiny", {"model": {field: value}})


def test_forward_macs_by_hand():
    # tiny at 16^3: enc0 27*1*4*16^3, enc1 27*4*8*8^3, enc2 27*8*16*4^3, dec1 up 16*8*8^3 + conv 27*16*8*8^3,
    # dec0 up 8*4*16^3 + conv 27*8*4*16^3, head 4*3*16^3
    expected = (27 * 4 * 4096 + 27 * 32 * 512 + 27 * 128 * 64 + 128 * 512 + 27 * 128 * 512
                + 32 * 4096 + 27 * 32 * 4096 + 12 * 4096)
    model = tiny_model().build_for()
    assert model.forward_macs((16, 16, 16)) == expected == 6_660_096
    assert model.train_flops((16, 16, 16), batch_size=2) == 12 * expected


def test_kits19_training_flops_match_the_reference():
    # ~180 TFLOP per 512^3 training step, 1.37 MFLOP per voxel: the figure kits19's network was specified against.
    model = UNet3D(resolve_config("kits19").model).build_for()
    per_voxel = model.train_flops((64, 64, 64)) / 64**3
    assert per_voxel == pytest.approx(1.37e6, rel=0.01)
    assert model.train_flops((512, 512, 512)) == pytest.approx(180e12, rel=0.03)


def test_stock_layers_build_the_same_network_from_keras_layers():
    """The plain-Keras baseline of bench_train.py: same parameters, Keras's own norm and concatenation."""
    config = resolve_config("tiny", {"model": {"base_filters": 16}}).model  # wide enough for two-input skips
    ours = UNet3D(config).build_for()
    stock = UNet3D(dataclasses.replace(config, stock_layers=True)).build_for()
    assert stock.count_params() == ours.count_params()
    kinds = {type(layer).__name__ for layer in stock._flatten_layers()}
    assert {"GroupNormalization", "Concatenate", "ReLU"} <= kinds
    assert "NormActivation" not in kinds
    kinds = {type(layer).__name__ for layer in ours._flatten_layers()}
    assert "NormActivation" in kinds
    assert "Concatenate" not in kinds
    assert "GroupNormalization" not in kinds
    assert UNet3D.from_config(stock.get_config()).model_config.stock_layers is True


def test_deep_supervision_outputs_each_supervised_level_in_training_only():
    model = UNet3D({"depth": 3, "base_filters": 4, "num_classes": 3, "deep_supervision": True})
    x = np.zeros((2, 16, 24, 32, 1), np.float32)
    outputs = model(x, training=True)
    assert [tuple(o.shape) for o in outputs] == [(2, 16, 24, 32, 3), (2, 8, 12, 16, 3)]  # level 2 has weight 0
    assert tuple(model(x).shape) == (2, 16, 24, 32, 3)  # inference: the full resolution alone
    assert sorted(model.supervision_heads) == [1]


def test_deep_supervision_adds_only_the_heads_parameters():
    plain = UNet3D({"depth": 4, "base_filters": 4, "num_classes": 3}).build_for()
    supervised = UNet3D({"depth": 4, "base_filters": 4, "num_classes": 3, "deep_supervision": True}).build_for()
    # levels 1 and 2 (8 and 16 channels) -> 3 classes, with bias: (8 + 1) * 3 + (16 + 1) * 3
    assert supervised.count_params() - plain.count_params() == 9 * 3 + 17 * 3


def test_deep_supervision_heads_report_their_feature_maps():
    model = UNet3D({"depth": 3, "base_filters": 4, "num_classes": 3, "deep_supervision": True})
    counts = model.block_feature_map_elements((16, 16, 16))
    assert counts["head1"] == 2 * 3 * 8**3  # its logits and their float32 cast at 8^3
    assert "head2" not in counts


def test_deep_supervision_round_trips_through_keras_save(tmp_path):
    model = UNet3D({"depth": 3, "base_filters": 4, "num_classes": 2, "deep_supervision": True}).build_for()
    x = np.random.default_rng(0).normal(size=(1, 16, 16, 16, 1)).astype(np.float32)
    model.save(tmp_path / "ds.keras")
    loaded = keras.models.load_model(tmp_path / "ds.keras")
    assert loaded.model_config.deep_supervision is True
    for ours, theirs in zip(model(x, training=True), loaded(x, training=True)):
        np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), atol=1e-5)


def test_presets_train_without_deep_supervision():
    for preset in ("tiny", "small", "intelai-brats", "kits19"):
        assert resolve_config(preset).model.deep_supervision is False
