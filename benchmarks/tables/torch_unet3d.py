"""The 3D U-Net of a bigmem ModelConfig written as a PyTorch user would (bench_train.py's baseline).

Same channels, strides, kernel sizes, norm and activation as ``bigmem.nets.unet3d.UNet3D``:
3x3x3 conv (bias only without a norm) -> InstanceNorm3d/GroupNorm/BatchNorm3d (affine) -> ReLU,
max pool or strided first conv down, 2x2x2 stride-2 ConvTranspose3d (with bias) up,
concatenate the skip, 1x1x1 head. NCDHW, float32, eager: the standard PyTorch training loop.
Needs ``pip install .[bench]``; bigmem itself never imports torch, and this file never imports
bigmem: the GPU reference (benchmarks/performance/gpu_reference.py) runs it where only PyTorch is
installed. ``config`` is a ``bigmem.config.schema.ModelConfig`` or anything with its fields, options
as their strings (bigmem's options are ``str`` enums, so both compare equal to "instance").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from bigmem.config.schema import ModelConfig

INSTANCE_NORM_EPSILON = 1e-5  # as bigmem.nets.blocks
LEAKY_RELU_SLOPE = 0.01


def _norm(config: ModelConfig, channels: int) -> nn.Module | None:
    if config.norm == "instance":
        return nn.InstanceNorm3d(channels, eps=INSTANCE_NORM_EPSILON, affine=True)
    if config.norm == "group":
        return nn.GroupNorm(config.groups, channels, eps=INSTANCE_NORM_EPSILON)
    if config.norm == "batch":
        return nn.BatchNorm3d(channels, eps=1e-3)
    return None


def conv_norm_act(config: ModelConfig, in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    norm = _norm(config, out_channels)
    layers: list[nn.Module] = [nn.Conv3d(in_channels, out_channels, 3, stride=stride, padding=1,
                                         bias=config.conv_bias)]
    if norm is not None:
        layers.append(norm)
    layers.append(nn.LeakyReLU(LEAKY_RELU_SLOPE, inplace=True) if config.activation == "leaky_relu"
                  else nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class TorchUNet3D(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.residual:
            raise ValueError("the PyTorch baseline implements plain (non-residual) blocks only")
        filters = config.filters
        self.pool = nn.MaxPool3d(2) if config.downsampling == "maxpool" else None
        self.encoder = nn.ModuleList()
        for level, width in enumerate(filters):
            first_in = filters[level - 1] if level else config.in_channels
            stride = 2 if level and config.downsampling == "strided" else 1
            blocks = [conv_norm_act(config, first_in, width, stride)]
            blocks += [conv_norm_act(config, width, width) for _ in range(config.blocks_per_level - 1)]
            self.encoder.append(nn.Sequential(*blocks))
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for level in reversed(range(config.depth)):
            width = filters[level]
            self.up.append(nn.ConvTranspose3d(filters[level + 1], width, 2, stride=2))
            blocks = [conv_norm_act(config, 2 * width, width)]
            blocks += [conv_norm_act(config, width, width) for _ in range(config.blocks_per_level - 1)]
            self.decoder.append(nn.Sequential(*blocks))
        self.head = nn.Conv3d(filters[0], config.num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level, stage in enumerate(self.encoder):
            if level and self.pool is not None:
                x = self.pool(x)
            x = stage(x)
            skips.append(x)
        skips.pop()
        for up, stage in zip(self.up, self.decoder):
            x = stage(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


def dice_ce_loss(logits: torch.Tensor, labels: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """bigmem.train.losses.dice_ce_loss in PyTorch: voxel cross-entropy + (1 - mean foreground soft Dice)."""
    num_classes = logits.shape[1]
    cross_entropy = nn.functional.cross_entropy(logits, labels)
    probs = torch.softmax(logits, dim=1)
    onehot = nn.functional.one_hot(labels, num_classes).permute(0, 4, 1, 2, 3).to(probs.dtype)
    spatial = (2, 3, 4)
    intersection = (probs * onehot).sum(spatial)
    denominator = probs.sum(spatial) + onehot.sum(spatial)
    dice = (2.0 * intersection + smooth) / (denominator + smooth)
    return cross_entropy + (1.0 - dice[:, 1:].mean(dim=1)).mean()


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
