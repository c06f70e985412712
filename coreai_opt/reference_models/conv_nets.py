"""Small convolutional networks beside the ResNet / MobileNet families.

A ConvTranspose encoder/decoder with a skip concat, a 1-D conv stack with GroupNorm, and the digits CNN of the
quickstart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvTransposeDecoder", "Conv1dGroupNorm", "DigitsCNN"]


class ConvTransposeDecoder(nn.Module):
    """U-Net-like encoder/decoder: strided convs down, ConvTranspose2d up, skip concatenation."""

    def __init__(self, in_channels: int = 3, width: int = 16, out_channels: int = 3) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, 2, 1), nn.ReLU())
        self.bottleneck = nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, 1, 1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * width, width, 3, 1, 1), nn.ReLU())
        self.head = nn.Conv2d(width, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        b = self.bottleneck(self.enc2(e1))
        u = F.relu(self.up(b))
        return self.head(self.dec(torch.cat([u, e1], dim=1)))


class Conv1dGroupNorm(nn.Module):
    """1-D conv stack with GroupNorm, SiLU, average pooling and a linear head. Input ``(batch, ch, length)``."""

    def __init__(self, in_channels: int = 4, width: int = 32, num_classes: int = 10, groups: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, width, 5, padding=2)
        self.gn1 = nn.GroupNorm(groups, width)
        self.conv2 = nn.Conv1d(width, width, 3, padding=1, stride=2)
        self.gn2 = nn.GroupNorm(groups, width)
        self.act = nn.SiLU()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.gn1(self.conv1(x)))
        x = self.act(self.gn2(self.conv2(x)))
        return self.head(torch.flatten(self.pool(x), 1))


class DigitsCNN(nn.Module):
    """Small CNN (3 conv + BN + ReLU, ~24k params) for 8x8 digits or 28x28 MNIST, single channel input."""

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(4 * width),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))
