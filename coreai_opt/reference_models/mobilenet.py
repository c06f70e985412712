"""MobileNetV2-style network: inverted residual blocks (depthwise convs, ReLU6) and a hardswish head."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["InvertedResidual", "MobileNetV2Style", "mobilenet_v2_style"]


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1 project, residual when shapes match."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = in_ch * expand
        self.use_residual = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(in_ch, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2Style(nn.Module):
    """MobileNetV2 layout (depthwise convs, ReLU6) with a hardswish head, as in MobileNetV3 classifiers."""

    # (expansion, out channels, repeats, stride) of the original network
    SETTINGS: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, in_channels: int = 3) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(math.ceil(c * width_mult / 8) * 8))

        in_ch = ch(32)
        features: list[nn.Module] = [
            nn.Sequential(
                nn.Conv2d(in_channels, in_ch, 3, 2, 1, bias=False), nn.BatchNorm2d(in_ch), nn.ReLU6(inplace=True)
            )
        ]
        for expand, c, n, s in self.SETTINGS:
            out_ch = ch(c)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, expand))
                in_ch = out_ch
        last = ch(1280)
        features.append(
            nn.Sequential(nn.Conv2d(in_ch, last, 1, bias=False), nn.BatchNorm2d(last), nn.Hardswish())
        )
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2_style(num_classes: int = 1000, width_mult: float = 1.0, in_channels: int = 3) -> MobileNetV2Style:
    """Build a MobileNetV2-style network; ``width_mult=1.0`` gives the standard widths."""
    return MobileNetV2Style(num_classes, width_mult, in_channels)
