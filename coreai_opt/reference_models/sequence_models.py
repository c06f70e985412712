"""Models on ``(batch, sequence, ...)`` inputs.

The hand-written transformer encoder (FX traceable), a GPT-style causal decoder (an LM head over every position),
a classifier on ``nn.TransformerEncoderLayer`` and a model that unpacks its input's shape (both need
``torch.export`` capture).
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
    "CausalBlock",
    "GPTStyleDecoder",
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


class CausalBlock(nn.Module):
    """Pre-LayerNorm GPT block: causal multi-head attention (one fused ``qkv`` linear) and a GELU MLP, both residual.

    ``softmax(q kᵀ / sqrt(d_head))`` with the future masked to ``-inf`` (a ``tril`` buffer of ``max_len``).
    """

    def __init__(self, dim: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTStyleDecoder(nn.Module):
    """A GPT-style LM: logits ``[B, T, vocab]`` for token ids ``[B, T]``, ``T <= max_len``.

    Token + learned position embeddings (``N(0, position_std²)``), ``depth`` :class:`CausalBlock`, LayerNorm, LM head.
    """

    def __init__(self, vocab: int, max_len: int, dim: int = 64, depth: int = 2, heads: int = 4,
                 position_std: float = 0.02) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * position_std)
        self.blocks = nn.Sequential(*[CausalBlock(dim, heads, max_len) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.ln(self.blocks(self.tok(tokens) + self.pos[:, : tokens.shape[1]])))


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
