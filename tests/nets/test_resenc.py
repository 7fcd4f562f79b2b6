"""nnU-Net's residual-encoder U-Net (``model.residual_encoder``) and per-stage block counts, against
dynamic-network-architectures' networks; shapes per axis; serialisation.

The reference counts were computed once, outside bigmem's environment, with dynamic-network-architectures
0.4.4 and torch 2.14.1 (nnunetv2 2.8.1 installed beside them), as ``sum(p.numel() for p in net.parameters())``
of the constructor call in each comment, every call also given

    conv_op=nn.Conv3d, conv_bias=True, norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
    dropout_op=None, dropout_op_kwargs=None, nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True},
    deep_supervision=True

(nnU-Net's ResEnc planners' and default planner's arch_kwargs). One difference is expected and explained: the
torch decoder (``UNetDecoder``) builds a 1x1x1 segmentation head with bias at every decoder stage, deep
supervision or not ("so that we can always load parameters"); bigmem builds the main head and, with deep
supervision, one per supervised level (``ModelConfig.supervised_levels``), none at the lowest decoder level,
whose loss weight nnU-Net sets to 0 (``nnUNetTrainer._build_loss``: ``weights[-1] = 0``). So bigmem has
``(filters[depth - 1] + 1) * num_classes`` parameters fewer with deep supervision, and every lower head's fewer
without it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.nets.blocks import ConvNormAct, ResidualBlock
from bigmem.nets.unet3d import UNet3D

NNUNET = {"norm": "instance", "activation": "leaky_relu", "downsampling": "strided", "conv_bias": True,
          "deep_supervision": True}
ANISOTROPIC_KERNELS = [[1, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]]
ANISOTROPIC_STRIDES = [[1, 1, 1], [1, 2, 2], [2, 2, 2], [2, 2, 2]]


def _head(channels: int, classes: int) -> int:
    """Parameters of a 1x1x1 head with bias."""
    return (channels + 1) * classes


@pytest.fixture(scope="module")
def resenc_m() -> UNet3D:
    return UNet3D(resolve_config("resenc-m").model).build_for()


def test_resenc_m_counts_as_dynamic_network_architectures(resenc_m):
    # ResidualEncoderUNet(input_channels=1, n_stages=6, features_per_stage=(32, 64, 128, 256, 320, 320),
    #                     kernel_sizes=[[3, 3, 3]] * 6, strides=[[1, 1, 1]] + [[2, 2, 2]] * 5,
    #                     n_blocks_per_stage=(1, 3, 4, 6, 6, 6), num_classes=3,
    #                     n_conv_per_stage_decoder=(1, 1, 1, 1, 1), ...): 102,350,575 parameters; its seg heads,
    #                     lowest level first: 963, 771, 387, 195, 99.
    torch_count = 102_350_575
    assert resenc_m.count_params() == torch_count - _head(320, 3) == 102_349_612


def test_anisotropic_resenc_counts_as_dynamic_network_architectures():
    # ResidualEncoderUNet(input_channels=2, n_stages=4, features_per_stage=(8, 16, 32, 64),
    #                     kernel_sizes=[[1, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]],
    #                     strides=[[1, 1, 1], [1, 2, 2], [2, 2, 2], [2, 2, 2]], n_blocks_per_stage=(1, 3, 4, 6),
    #                     num_classes=4, n_conv_per_stage_decoder=(1, 1, 1), ...): 1,616,548 parameters; its seg
    #                     heads, lowest level first: 132, 68, 36.
    torch_count = 1_616_548
    config = {**NNUNET, "depth": 3, "base_filters": 8, "in_channels": 2, "num_classes": 4, "residual_encoder": True,
              "encoder_blocks": [1, 3, 4, 6], "decoder_blocks": 1, "kernel_sizes": ANISOTROPIC_KERNELS,
              "strides": ANISOTROPIC_STRIDES}
    assert UNet3D(config).build_for().count_params() == torch_count - _head(32, 4) == 1_616_416
    # Without deep supervision bigmem keeps the main head alone; the torch network is the same either way.
    plain_head = UNet3D({**config, "deep_supervision": False}).build_for()
    assert plain_head.count_params() == torch_count - _head(32, 4) - _head(16, 4) == 1_616_348


def test_anisotropic_plain_unet_counts_as_plain_conv_unet():
    # PlainConvUNet(input_channels=1, n_stages=4, features_per_stage=(8, 16, 32, 64),
    #               kernel_sizes=[[1, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]],
    #               strides=[[1, 1, 1], [1, 2, 2], [2, 2, 2], [2, 2, 2]], n_conv_per_stage=2, num_classes=3,
    #               n_conv_per_stage_decoder=2, ...): 346,065 parameters; its seg heads, lowest level first: 99, 51, 27.
    # bigmem's decoder convolves [upsampled, skip] as two inputs (ConvNormAct num_inputs=2): the same kernel
    # split in two, one bias, so the same count.
    torch_count = 346_065
    config = {**NNUNET, "depth": 3, "base_filters": 8, "blocks_per_level": 2, "num_classes": 3,
              "kernel_sizes": ANISOTROPIC_KERNELS, "strides": ANISOTROPIC_STRIDES}
    assert UNet3D(config).build_for().count_params() == torch_count - _head(32, 3) == 345_966


# A tiny per-axis ResEnc: the depth axis is convolved plane by plane at full resolution and pooled a stage later.
TINY = {**NNUNET, "depth": 3, "base_filters": 4, "max_filters": 8, "residual_encoder": True,
        "encoder_blocks": [1, 2, 2, 1, 9], "decoder_blocks": 1, "kernel_sizes": ANISOTROPIC_KERNELS,
        "strides": ANISOTROPIC_STRIDES}


@pytest.fixture(scope="module")
def tiny() -> UNet3D:
    return UNet3D(TINY).build_for()


def test_the_stem_comes_first_at_the_first_stages_kernel(tiny):
    stem = tiny.encoder[0].stem
    assert isinstance(stem, ConvNormAct)
    assert stem.conv.kernel.shape == (1, 3, 3, 1, 4)  # in_channels -> base_filters, the stage-0 kernel
    assert stem.strides == (1, 1, 1)
    assert [stage.stem is None for stage in tiny.encoder] == [False, True, True, True]


def test_encoder_stages_have_their_blocks_and_the_first_strides(tiny):
    assert [len(stage.blocks) for stage in tiny.encoder] == [1, 2, 2, 1]  # the list's first depth + 1
    assert all(isinstance(block, ResidualBlock) for stage in tiny.encoder for block in stage.blocks)
    assert [stage.blocks[0].strides for stage in tiny.encoder] == [(1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2)]
    assert tiny.encoder[1].blocks[1].strides == (1, 1, 1)


def test_shortcuts_pool_by_the_stride_then_project_without_bias(tiny):
    stage0, stage1, stage3 = tiny.encoder[0].blocks[0], tiny.encoder[1].blocks[0], tiny.encoder[3].blocks[0]
    assert (stage0.pool, stage0.proj) == (None, None)  # stride 1, 4 -> 4 channels: the identity
    assert stage1.pool.pool_size == (1, 2, 2)
    assert stage1.pool.strides == (1, 2, 2)
    assert stage1.proj.kernel.shape == (1, 1, 1, 4, 8)  # 4 -> 8 channels, stride 1 after the pool
    assert stage1.proj.bias is None  # bias-free although the convolutions have one
    assert stage1.first.conv.bias is not None
    assert stage3.pool.pool_size == (2, 2, 2)
    assert stage3.proj is None  # 8 -> 8 channels (max_filters): the pool alone


def test_the_decoder_is_plain_with_decoder_blocks(tiny):
    assert [len(stage.blocks) for stage in tiny.decoder] == [1, 1, 1]
    assert all(type(block) is ConvNormAct for stage in tiny.decoder for block in stage.blocks)


def test_each_residual_branch_starts_at_zero(tiny):
    for stage in tiny.encoder:
        for block in stage.blocks:
            np.testing.assert_array_equal(np.asarray(block.norm_layer.gamma), 0.0)
            np.testing.assert_array_equal(np.asarray(block.norm_layer.beta), 0.0)


@pytest.mark.parametrize("shape", [(4, 8, 8), (8, 16, 24)])  # multiples of (4, 8, 8)
def test_per_axis_shapes_in_training_and_inference(tiny, shape):
    x = np.random.default_rng(0).normal(size=(2, *shape, 1)).astype(np.float32)
    outputs = tiny(x, training=True)
    d, h, w = shape
    assert [tuple(o.shape) for o in outputs] == [(2, d, h, w, 3), (2, d, h // 2, w // 2, 3)]
    assert all(o.dtype == "float32" for o in outputs)
    assert tuple(tiny(x).shape) == (2, d, h, w, 3)


def test_max_pooling_residual_encoder_runs():
    """ResidualEncoder's pool_type="max": each stage pools, then its blocks run at stride 1."""
    model = UNet3D({**TINY, "downsampling": "maxpool"}).build_for()
    assert model.encoder[1].pool.pool_size == (1, 2, 2)
    assert model.encoder[1].blocks[0].strides == (1, 1, 1)
    assert model.encoder[1].blocks[0].pool is None
    assert tuple(model(np.zeros((1, 4, 16, 8, 1), np.float32)).shape) == (1, 4, 16, 8, 3)


def test_the_model_sums_its_stages(tiny):
    per_stage = tiny.block_feature_map_elements((4, 16, 24))
    assert tiny.feature_map_elements((4, 16, 24)) == sum(per_stage.values())
    # enc0 at 4 x 16 x 24: the stem (conv, norm-act) and one identity block (its first conv-norm-act, conv,
    # norm, add, activation), all of 4 channels.
    assert per_stage["enc0"] == (2 + 2 + 4) * 4 * 4 * 16 * 24


def test_get_config_round_trip(tiny):
    clone = UNet3D.from_config(tiny.get_config()).build_for()
    assert clone.model_config == tiny.model_config
    clone.set_weights(tiny.get_weights())
    x = np.random.default_rng(1).normal(size=(1, 4, 8, 8, 1)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(clone(x)), np.asarray(tiny(x)))


def test_keras_file_round_trip(tmp_path, tiny):
    x = np.random.default_rng(2).normal(size=(1, 4, 8, 8, 1)).astype(np.float32)
    tiny.save(tmp_path / "resenc.keras")
    loaded = keras.models.load_model(tmp_path / "resenc.keras")
    assert loaded.model_config.residual_encoder is True
    for theirs, ours in zip(loaded(x, training=True), tiny(x, training=True)):
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours))


def test_encoder_and_decoder_blocks_set_the_plain_network_too():
    model = UNet3D({"depth": 2, "base_filters": 4, "encoder_blocks": [3, 1, 2], "decoder_blocks": 1}).build_for()
    assert [len(stage.blocks) for stage in model.encoder] == [3, 1, 2]
    assert [len(stage.blocks) for stage in model.decoder] == [1, 1]
    assert all(stage.stem is None for stage in model.encoder)
