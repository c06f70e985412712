"""Models on ``(batch, sequence, ...)`` inputs.

The hand-written transformer encoder (FX traceable), a classifier on ``nn.TransformerEncoderLayer`` and a model
that unpacks its input's shape (both need ``torch.export`` capture).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SelfAttention",
    "EncoderBlock",
    "TransformerEncoderClassifier",
    "transformer_encoder",
    "TorchTransformerClassifier",
    "ShapeUnpackModel",
]


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
