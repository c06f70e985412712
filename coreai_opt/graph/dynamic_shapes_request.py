"""The ``dynamic_shapes`` a ``torch.export`` capture asks for (what it got back is :mod:`.dynamic_dims`).

By default dimension 0 of every tensor is dynamic, and every further dimension of a top-level tensor argument
where the model allows it (``Dim.AUTO``: the model's weights and code then fix channels and feature widths); the
user's per-argument entries replace the default. Example sizes of 0 or 1 stay constants.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["check_dynamic_shapes", "optional_dims", "export_dynamic_shapes"]


def _dynamic_batch(value: Any, sizes: list[int]) -> Any:
    """Dim 0 of every tensor dynamic (``Dim.AUTO``) unless its example size is 0 or 1 (records every dim-0 size)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1:
            sizes.append(value.shape[0])
        return {0: torch.export.Dim.AUTO} if value.dim() >= 1 and value.shape[0] > 1 else None
    if isinstance(value, (tuple, list)):
        return type(value)(_dynamic_batch(v, sizes) for v in value)
    if isinstance(value, dict):
        return {k: _dynamic_batch(v, sizes) for k, v in value.items()}
    return None


def check_dynamic_shapes(model: nn.Module, dynamic_shapes: dict[str, Any] | None) -> None:
    """Refuse a ``dynamic_shapes`` that is not a dict keyed by ``model.forward``'s argument names."""
    if dynamic_shapes is None:
        return
    if not isinstance(dynamic_shapes, dict):
        raise TypeError(f"dynamic_shapes must be a dict keyed by forward argument name, got "
                        f"{type(dynamic_shapes).__name__}; e.g. dynamic_shapes={{'x': None}} keeps x static")
    names = list(inspect.signature(model.forward).parameters)
    unknown = sorted(set(dynamic_shapes) - set(names))
    if unknown:
        raise ValueError(f"dynamic_shapes names {unknown}, which are not arguments of {type(model).__name__}.forward "
                         f"(its arguments: {names})")


def optional_dims(bound: dict[str, Any], dynamic_shapes: dict[str, Any] | None) -> dict[str, dict[int, Any]]:
    """Dimensions 1.. of every top-level tensor argument the user left to the default, of example size > 1."""
    return {name: {d: torch.export.Dim.AUTO for d in range(1, value.dim()) if value.shape[d] > 1}
            for name, value in bound.items() if isinstance(value, torch.Tensor) and name not in (dynamic_shapes or {})}


def export_dynamic_shapes(bound: dict[str, Any], dynamic_shapes: dict[str, Any] | None) -> dict[str, Any]:
    """The default per-argument spec with the user's ``dynamic_shapes`` entries replacing it where given.

    The default makes dimension 0 of every tensor dynamic, and every further dimension of a top-level tensor
    argument dynamic where the model allows it (see :func:`optional_dims`). A dimension of size 0 or 1 in the
    example cannot be exported as dynamic (torch.export would trace the size-1 special cases of every op), so it
    stays a constant; when that is the batch of every input a warning says so.
    """
    sizes: list[int] = []
    spec = {name: _dynamic_batch(value, sizes) for name, value in bound.items()}
    for name, dims in optional_dims(bound, dynamic_shapes).items():
        spec[name] = {**(spec[name] or {}), **dims} or None
    if dynamic_shapes is None and sizes and max(sizes) <= 1:
        warnings.warn(
            f"every example input has batch {max(sizes)}; torch.export captures a batch of 0 or 1 as a constant, so "
            "the prepared model only accepts that batch size. For a dynamic batch give an example batch of at "
            "least 2",
            UserWarning,
            stacklevel=4,
        )
    return {**spec, **(dynamic_shapes or {})}
