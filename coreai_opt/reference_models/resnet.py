"""ResNet-style networks: basic and bottleneck residual blocks, the four-stage layout, ResNet-18 / -50 factories."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNetStyle", "resnet18_style", "resnet50_style"]


def _downsample(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    """The shortcut's 1x1 conv + BatchNorm where the block changes the shape, else None (identity)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu, conv-bn, residual add, relu."""

    expansion = 1

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1 reduce, 3x3, 1x1 expand by 4) with a residual add."""

    expansion = 4

    def __init__(self, in_ch: int, mid_ch: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = mid_ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_ch)
        self.conv2 = nn.Conv2d(mid_ch, mid_ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_ch)
        self.conv3 = nn.Conv2d(mid_ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNetStyle(nn.Module):
    """ResNet with a 7x7 stem, max-pool, four stages, global average pool and a linear classifier."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock,
        layers: tuple[int, int, int, int] = (2, 2, 2, 2),
        width: int = 64,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        stages = []
        in_ch = width
        for i, n_blocks in enumerate(layers):
            ch = width * 2**i
            blocks = []
            for j in range(n_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_ch, ch, stride))
                in_ch = ch * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet18_style(num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> ResNetStyle:
    """Build a ResNet-18 layout (BasicBlock, 2-2-2-2); ``width=64`` gives the standard widths."""
    return ResNetStyle(BasicBlock, (2, 2, 2, 2), width, num_classes, in_channels)


def resnet50_style(num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> ResNetStyle:
    """Build a ResNet-50 layout (Bottleneck, 3-4-6-3); ``width=64`` gives the standard widths."""
    return ResNetStyle(Bottleneck, (3, 4, 6, 3), width, num_classes, in_channels)
