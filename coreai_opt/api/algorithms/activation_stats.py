"""Per-channel activation statistics of the inputs of every ``nn.Linear``: outlier analysis and SmoothQuant input.

``input_absmax(model, data)`` runs float batches through ``model`` with forward pre-hooks and keeps, for every
linear layer, ``max|X_j|`` over all tokens for each input channel ``j`` (a ``(in_features,)`` tensor); the
running per-channel maximum is :class:`ChannelAbsMax` (SmoothQuant measures its sites with it too).
``outlier_table(stats)`` summarises each layer: the largest channel maximum, the median one, their ratio
(how much of the per-tensor int8 range one channel wastes) and the top channels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from coreai_opt.api.internals.batches import as_call

__all__ = ["ChannelAbsMax", "LayerOutliers", "input_absmax", "outlier_rows", "outlier_table"]


class ChannelAbsMax:
    """Running ``max|X_j|`` over every token of named tensors, per channel ``j`` of the last dimension.

    Attributes:
        values: ``{name: (channels,) float32 tensor}`` of the tensors seen so far.
    """

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def update(self, name: str, x: Tensor) -> Tensor:
        """Fold ``x`` into ``values[name]``; return its float32 ``(tokens, channels)`` view for further use."""
        flat = x.detach().float().reshape(-1, x.shape[-1])
        if flat.shape[0] == 0:  # no token in this batch (e.g. an empty boolean-mask selection): nothing to fold
            return flat
        amax = flat.abs().amax(dim=0)
        seen = self.values.get(name)
        self.values[name] = amax if seen is None else torch.maximum(seen, amax)
        return flat


def input_absmax(model: nn.Module, data: Iterable[Any]) -> dict[str, Tensor]:
    """``{linear module name: max|X_j| per input channel}`` over every token of ``data`` (float model).

    Raises:
        ValueError: no batch, or the model has no ``nn.Linear`` that was called.
    """
    stats = ChannelAbsMax()
    hooks = []

    def hook(name: str):  # noqa: ANN202
        def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
            stats.update(name, args[0])
        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(hook(name)))
    count = 0
    try:
        with torch.no_grad():
            for batch in data:
                args, kwargs = as_call(batch)
                model(*args, **kwargs)
                count += 1
    finally:
        for h in hooks:
            h.remove()
    if count == 0:
        raise ValueError("input_absmax needs at least one batch of data")
    if not stats.values:
        raise ValueError(f"{type(model).__name__} called no torch.nn.Linear; nothing to measure")
    return stats.values


@dataclass(frozen=True)
class LayerOutliers:
    """Outlier summary of one linear layer's input."""

    layer: str
    max_abs: float
    median_channel_max: float
    ratio: float
    top_channels: tuple[int, ...]


def outlier_rows(stats: dict[str, Tensor], top: int = 3) -> list[LayerOutliers]:
    """One :class:`LayerOutliers` per layer, largest ratio first."""
    rows = []
    for name, amax in stats.items():
        median = float(amax.median())
        rows.append(LayerOutliers(name, float(amax.max()), median, float(amax.max()) / max(median, 1e-12),
                                  tuple(int(i) for i in torch.argsort(amax, descending=True)[:top])))
    rows.sort(key=lambda r: r.ratio, reverse=True)
    return rows


def outlier_table(stats: dict[str, Tensor], top: int = 3) -> str:
    """Markdown table of :func:`outlier_rows`."""
    lines = ["| layer (input of) | max abs | median channel max | ratio | top channels |", "|---|---:|---:|---:|---|"]
    for r in outlier_rows(stats, top):
        lines.append(f"| `{r.layer}` | {r.max_abs:.2f} | {r.median_channel_max:.3f} | {r.ratio:.1f} | "
                     f"{', '.join(map(str, r.top_channels))} |")
    return "\n".join(lines)
