"""Tensor functions the graph passes insert (torch only, no graph code), listed in the op table like torch's own."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_softmax"]


def masked_softmax(scores: Tensor, scale: float, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    r"""``softmax(scale · scores + mask)`` over the last axis, with SDPA's mask rules.

    A bool ``mask`` is ``True`` where attention is allowed (else :math:`-\infty`), a float one is added;
    ``is_causal`` masks key positions after the query position (upper-left aligned). Rows whose every
    position is masked give zeros instead of NaN.

    Which rows are fully masked is read from the mask, not from the logits: with :math:`A` the allowed positions
    (the bool mask and the causal band) and :math:`M` the float mask,

    .. math::

        \mathrm{dead}_i = \neg \exists j:\; A_{ij} \wedge M_{ij} \neq -\infty

    is computed in the mask's own (broadcast) shape, typically ``[batch, 1, L, S]`` rather than the scores'
    ``[batch, heads, L, S]``, and every attention layer reading the same mask computes the same ``dead`` (one
    subexpression, which onnxruntime evaluates once). It equals "every logit is :math:`-\infty`" whenever the
    scores are finite, which holds for quantized scores (a dequantized integer times a finite scale).

    With a bool mask (or none) the masking is arithmetic, in the mask's shape: ``logits + where(A or dead, 0, -inf)``,
    then the probabilities times ``1 - dead`` (exact: ``x + 0 = x``, ``x + (-inf) = -inf`` for finite ``x``, and
    ``p · 1 = p``); a dead row's logits stay finite and its probabilities become ``p · 0 = 0``.

    Args:
        scores: :math:`Q K^\top`, ``[..., L, S]``.
        scale: The softmax scale.
        mask: Broadcastable to ``scores``; bool or floating.
        is_causal: Apply the causal mask.

    Returns:
        Attention probabilities of the shape of ``scores``.
    """
    logits = scores * scale
    allowed = None
    if is_causal:
        length, source = logits.shape[-2], logits.shape[-1]
        allowed = torch.ones(length, source, dtype=torch.bool, device=logits.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask if allowed is None else allowed & mask
    if mask is None or mask.dtype == torch.bool:
        if allowed is None:
            return torch.softmax(logits, dim=-1)
        # additive mask and row factor in the mask's shape (computed once for all layers in onnxruntime, which
        # broadcasts Add / Mul faster than Where): a dead row gets finite logits, then a factor of 0
        dead = allowed.any(dim=-1, keepdim=True).logical_not()
        additive = torch.where(allowed | dead, 0.0, float("-inf")).to(logits.dtype)
        return torch.softmax(logits + additive, dim=-1) * dead.logical_not().to(logits.dtype)
    if allowed is not None:
        logits = logits + torch.where(allowed, 0.0, float("-inf")).to(logits.dtype)
    logits = logits + mask
    finite = mask.isneginf().logical_not()
    allowed = finite if allowed is None else allowed & finite
    probs = torch.softmax(logits, dim=-1)
    dead = allowed.any(dim=-1, keepdim=True).logical_not()
    return torch.where(dead, 0.0, probs)
