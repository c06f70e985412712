"""The exporter's copy of each rounded weight (GPTQ, HQQ, ...): materialised one weight at a time, when read.

A weight quantizer whose rounding algorithm holds a result exports ``DequantizeLinear(q, s, z)``: its trace feeds
the exact ``(q − z)·s`` (:meth:`~coreai_opt.quantization.rounding.weight_rounding.WeightRoundingBase.dequantized`)
from the algorithm's ``export_weight`` buffer, one float initializer that the fold turns back into ``q``. Holding
every such buffer at once is a float32 copy of every rounded weight next to the model's own weights (+1.0x of the
linear weights of a GPTQ model, for the whole export). So, for the trace only (:func:`rounded_weight_buffers`):

* a weight below :data:`~coreai_opt.onnx.export.prequantize_weights.PREQUANTIZE_MIN_BYTES` gets its real value (small,
  and the exporter's optimizer may read small initializers);
* a larger one gets an uninitialised ``torch.empty`` placeholder of its shape (untouched pages: no resident
  memory); the trace reads only its shape. Right after the trace :func:`bind_rounded_weights` replaces each
  initializer backed by a placeholder with a :class:`RoundedWeightTensor`, which computes the exact value when read,
  a slice of rows at a time: the fold (:mod:`~coreai_opt.onnx.export.prequantize_weights`) quantizes it back to
  ``q`` by rows, so no rounded weight's float value exists whole. Every placeholder must be found, or the export
  stops (no uninitialised memory is written).

The values, graph and file are those of the materialised buffers (byte-identical).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.onnx.export import prequantize_weights
from coreai_opt.quantization.rounding.weight_rounding import WeightRoundingBase

__all__ = ["RoundedWeightTensor", "bind_rounded_weights", "rounded_weight_buffers"]

#: data pointer of a placeholder -> the rounding algorithm whose value it stands for.
Placeholders = dict[int, WeightRoundingBase]


@contextmanager
def rounded_weight_buffers(model: nn.Module, lazy: bool) -> Iterator[Placeholders]:
    """Set every rounding result's ``export_weight`` for a trace of ``model``; clear them all afterwards.

    Args:
        model: The converted model.
        lazy: Placeholders for the large weights (the dynamo route, followed by :func:`bind_rounded_weights`);
            False materialises every weight (a route that serialises the traced tensors itself).

    Yields:
        The placeholders set (empty when ``lazy`` is False).
    """
    roundings = list({id(m): m for m in model.modules()
                      if isinstance(m, WeightRoundingBase) and m.has_result}.values())
    placeholders: Placeholders = {}
    try:
        for rounding in roundings:
            if lazy and rounding.qweight.numel() * 4 >= prequantize_weights.PREQUANTIZE_MIN_BYTES:
                rounding.export_weight = torch.empty(rounding.qweight.shape, device=rounding.qweight.device)
                placeholders[rounding.export_weight.data_ptr()] = rounding
            else:
                rounding.export_weight = rounding.dequantized()
        yield placeholders
    finally:
        for rounding in roundings:
            rounding.export_weight = None


class _DequantizedRows:
    """A rounded weight's exact dequantized value, read a slice of rows at a time (``RowSlices``)."""

    def __init__(self, rounding: WeightRoundingBase) -> None:
        self.rounding = rounding
        self.shape = tuple(rounding.qweight.shape)
        self.ndim = len(self.shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.rounding.dequantized_rows(rows).numpy()


class RoundedWeightTensor(ir.LazyTensor):
    """The exact ``(q − z)·s`` of a rounded weight, computed when read: whole, or by rows (:meth:`row_slices`).

    The fold quantizes it back to ``q`` by rows (:func:`~coreai_opt.onnx.export.prequantize_weights.quantize_rows`),
    so a weight's float copy never exists whole (a 32000 x 2048 head: 262 MB).
    """

    def __init__(self, rounding: WeightRoundingBase, like: ir.TensorProtocol) -> None:
        super().__init__(lambda: ir.Tensor(rounding.dequantized().numpy()), dtype=like.dtype, shape=like.shape,
                         name=like.name)
        self._rounding = rounding

    def row_slices(self) -> _DequantizedRows:
        """The value, read a slice of rows at a time."""
        return _DequantizedRows(self._rounding)


def bind_rounded_weights(model: ir.Model, placeholders: Placeholders) -> None:
    """Give each initializer of the exporter's ``model`` backed by a placeholder its lazily computed value.

    Raises:
        CoreaiOptRuntimeError: a placeholder is not an initializer of ``model`` (the exporter copied or dropped
            it), so its file would hold uninitialised memory; a coreai_opt bug, never expected.
    """
    found: set[int] = set()
    for value in model.graph.initializers.values():
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.numel() and raw.data_ptr() in placeholders:
            value.const_value = RoundedWeightTensor(placeholders[raw.data_ptr()], value.const_value)
            found.add(raw.data_ptr())
    missing = [rounding.name for pointer, rounding in placeholders.items() if pointer not in found]
    if missing:
        raise CoreaiOptRuntimeError(
            f"internal error: the exported model has no initializer for the rounded weights {missing[:5]}, so "
            "their values cannot be bound; please report it. Workaround: set "
            "coreai_opt.onnx.export.prequantize_weights.PREQUANTIZE_MIN_BYTES above the largest weight's size")
