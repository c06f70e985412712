"""``masked_softmax`` (graph/attention_math.py): its arithmetic masking equals the masked-fill form bit for bit."""

from __future__ import annotations

import pytest
import torch

from coreai_opt.graph.attention_math import masked_softmax


def _masked_fill_form(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """SDPA's rules written with ``masked_fill`` / ``where``: -inf where not allowed, zeros for dead rows."""
    logits, allowed = scores * scale, None
    if is_causal:
        allowed = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if mask is not None and mask.dtype != torch.bool:
        logits = logits + mask
        finite = ~mask.isneginf()
        allowed = finite if allowed is None else allowed & finite
    probs = torch.softmax(logits, dim=-1)
    if allowed is None:
        return probs
    return torch.where(~allowed.any(dim=-1, keepdim=True), 0.0, probs)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_masked_softmax_equals_the_masked_fill_form_bit_for_bit_with_dead_rows(mask_kind: str | None,
                                                                             is_causal: bool) -> None:
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 7) * 4
    allowed = torch.rand(2, 1, 5, 7) > 0.4
    allowed[0, 0, 2] = False  # a query row that may attend to nothing: zeros, not NaN
    mask = {None: None, "bool": allowed, "float": torch.where(allowed, 0.0, float("-inf"))}[mask_kind]
    got = masked_softmax(scores, 0.3, mask, is_causal)
    expected = _masked_fill_form(scores, 0.3, mask, is_causal)
    assert torch.equal(got, expected)
    assert not got.isnan().any()
    if mask_kind is not None:
        assert torch.equal(got[0, :, 2], torch.zeros_like(got[0, :, 2]))
