"""Hand-written reference networks shared by tests, examples, benchmarks and the demo.

torchvision cannot be installed beside the CPU torch build used here, so the architectures that
quantization toolkits are usually judged on are written out in plain ``torch.nn``. Each factory takes
width/depth knobs so that tests can build tiny versions and benchmarks full-size ones.

This module imports only torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNetStyle",
    "resnet18_style",
    "resnet50_style",
    "InvertedResidual",
    "MobileNetV2Style",
    "mobilenet_v2_style",
    "ConvTransposeDecoder",
    "SelfAttention",
    "EncoderBlock",
    "TransformerEncoderClassifier",
    "transformer_encoder",
    "TorchTransformerClassifier",
    "ShapeUnpackModel",
    "Conv1dGroupNorm",
    "DigitsCNN",
    "randomize_batchnorm",
]


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
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

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
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

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


class SelfAttention(nn.Module):
    """Multi-head self-attention from plain ``nn.Linear`` layers, matmul and softmax (FX traceable)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def _split(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim), dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2)
        return self.o(out.reshape(x.shape[0], -1, self.heads * self.head_dim))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * mlp_ratio)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * mlp_ratio, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class TransformerEncoderClassifier(nn.Module):
    """Token embedding + learned positions, a stack of encoder blocks, mean pooling and a linear head.

    Input: int64 token ids of shape ``(batch, seq)`` with ``seq <= max_len``.
    """

    def __init__(
        self,
        vocab_size: int = 1000,
        dim: int = 256,
        depth: int = 4,
        heads: int = 4,
        num_classes: int = 10,
        max_len: int = 128,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        x = self.ln(self.blocks(x))
        return self.head(x.mean(dim=1))


def transformer_encoder(
    dim: int = 256, depth: int = 4, heads: int = 4, vocab_size: int = 1000, num_classes: int = 10, max_len: int = 128
) -> TransformerEncoderClassifier:
    """Build the hand-written transformer encoder classifier (defaults: d256, 4 layers, 4 heads)."""
    return TransformerEncoderClassifier(vocab_size, dim, depth, heads, num_classes, max_len)


class TorchTransformerClassifier(nn.Module):
    """Classifier on ``nn.TransformerEncoderLayer``; its internals need ``torch.export`` capture.

    Input: float features of shape ``(batch, seq, dim)``.
    """

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class ShapeUnpackModel(nn.Module):
    """A model whose forward unpacks ``b, t, d = x.shape`` and branches on it (needs ``torch.export`` capture)."""

    def __init__(self, dim: int = 32, num_classes: int = 10, max_len: int = 512) -> None:
        super().__init__()
        self.max_len = max_len
        self.proj = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        h = F.gelu(self.proj(x)).reshape(b * t, d) / math.sqrt(d)
        h = self.mix(h).reshape(b, t, d)
        return self.head(h.mean(dim=1))


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


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters (in place), so folding matters.

    Freshly built models have mean 0, variance 1, weight 1 and bias 0, for which folding is nearly the identity.
    """
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.75)
                    m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model
