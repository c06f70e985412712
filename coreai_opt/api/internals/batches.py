"""How a data batch becomes a model call: the one convention every API that feeds batches to a model uses."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["as_call"]


def as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split a batch into ``(positional args, keyword args)``.

    A tensor is the single positional input, a tuple/list holds the positional inputs, a dict the keyword inputs.

    Raises:
        TypeError: Any other batch type (the message lists the accepted ones).
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise TypeError(
        f"calibration batches must be a tensor, a tuple/list of positional inputs or a dict of keyword inputs, "
        f"got {type(batch).__name__}"
    )
