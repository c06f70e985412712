"""Refuse a model whose weights hold NaN (or whose parameters hold Inf), naming the tensor.

A NaN weight makes every output computed from it NaN; observers ignore non-finite values, so the activation
quantizers downstream are never calibrated and ``convert`` would blame calibration. The check runs on the
captured graph in ``prepare`` (the user's tensor names) and again in ``convert`` (QAT can diverge). Infinite values
are refused in parameters only: buffers legitimately hold ``-inf`` (attention masks).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_finite_weights"]


def _problem(name: str, kind: str, tensor: torch.Tensor, count_inf: bool) -> str | None:
    """``"parameter 'w' holds 1 NaN of 4 values (first at index (1, 0))"``, or None when the tensor is fine."""
    values = tensor.detach()
    if values.numel() and bool(torch.isfinite(values.sum())):
        return None  # a NaN or Inf makes the sum non-finite; no element-sized masks for the common, clean case
    nan, inf = values.isnan(), values.isinf() if count_inf else torch.zeros_like(values, dtype=torch.bool)
    bad = nan | inf
    if not bool(bad.any()):
        return None
    counts = [f"{int(m.sum())} {label}" for m, label in ((nan, "NaN"), (inf, "Inf")) if bool(m.any())]
    first = tuple(int(i) for i in bad.nonzero()[0]) if values.dim() else ()
    return f"{kind} '{name}' holds {' and '.join(counts)} of {values.numel()} values (first at index {first})"


def check_finite_weights(model: nn.Module, step: str, fix: str) -> None:
    """Raise ``ValueError`` listing every parameter with NaN/Inf and every floating buffer with NaN.

    Args:
        model: The captured (or prepared) model.
        step: The API step, for the message (``"prepare"``, ``"convert"``).
        fix: What to do about it, appended to the message.

    Raises:
        ValueError: names each bad tensor, how many values are bad and where the first one is.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> with torch.no_grad():
        ...     layer.weight[1, 0] = float("nan")
        >>> check_finite_weights(layer, "prepare", "reload the weights")
        Traceback (most recent call last):
        ...
        ValueError: prepare: parameter 'weight' holds 1 NaN of 4 values (first at index (1, 0)); every output \
computed from it is NaN, so the quantizers after it can never be calibrated. Fix: reload the weights
    """
    found = [_problem(name, "parameter", t, True) for name, t in model.named_parameters() if t.is_floating_point()]
    found += [_problem(name, "buffer", t, False) for name, t in model.named_buffers() if t.is_floating_point()]
    problems = [p for p in found if p is not None]
    if problems:
        raise ValueError(
            f"{step}: {'; '.join(problems)}; every output computed from it is NaN, so the quantizers after it can "
            f"never be calibrated. Fix: {fix}"
        )
