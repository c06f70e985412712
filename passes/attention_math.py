"""Tensor functions the graph passes insert (torch only, no graph code), listed in the op table like torch's own."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_softmax"]


def masked_softmax(scores: Tensor, scale: float, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    r"""``softmax(scale · scores + mask)`` over the last axis, with SDPA's mask rules.

    A bool ``mask`` is ``True`` where attention is allowed (else :math:`-\infty`), a float one is added;
    ``is_causal`` masks key positions after the query position (upper-left aligned). Rows whose every
    position is :math:`-\infty` give zeros instead of NaN.

    Args:
        scores: :math:`Q K^\top`, ``[..., L, S]``.
        scale: The softmax scale.
        mask: Broadcastable to ``scores``; bool or floating.
        is_causal: Apply the causal mask.

    Returns:
        Attention probabilities of the shape of ``scores``.
    """
    logits = scores * scale
    if is_causal:
        length, source = logits.shape[-2], logits.shape[-1]
        allowed = torch.ones(length, source, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(allowed.logical_not(), float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(mask.logical_not(), float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1)
    return torch.where(logits.isneginf().all(dim=-1, keepdim=True), torch.zeros_like(probs), probs)
