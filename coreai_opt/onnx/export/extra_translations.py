"""ONNX translations torch's exporter lacks: transformers' grouped matmul and the stable sort.

**``transformers::grouped_mm_fallback``.** transformers' mixture-of-experts layers (Mixtral, Qwen2/3-MoE, GPT-OSS,
DeepSeek, GLM-4-MoE, Granite-MoE, ...) run their experts as ``torch.ops.transformers.grouped_mm_fallback(input,
weight, offs)`` on CPU float32, an op torch's exporter has no translation for, so every such model failed at export
(onnxruntime's own quantizer cannot export them either). With ``input`` (S, K) sorted by expert, ``weight``
(E, K, N) and ``offs`` (E,) the cumulative row count per expert::

    out[r] = input[r] @ weight[e]   for offs[e-1] <= r < offs[e]   (offs[-1] := 0)
    out[r] = 0                      for r >= offs[E-1]             (rows of no expert)

The translation writes one float ``MatMul`` per expert on the expert's rows (``Gather`` of ``Range(start, end)``),
``Concat`` of the blocks in row order and a zero block for the tail: exact, and it costs one GEMM over the routed
rows, not ``E`` GEMMs over all rows. ``E`` must be static (it is: the weight is a parameter).

**``aten.sort.stable``.** :mod:`coreai_opt.passes.order_ties` makes every sort stable, and torch's exporter
translates only the unstable overload. onnxruntime's ``TopK`` orders equal values by index, exactly a stable sort,
so ``sort(x, dim, descending, stable=True)`` is ``TopK(x, k=x.shape[dim], axis=dim, largest=descending, sorted=1)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from onnx import TensorProto

__all__ = ["extra_translation_table"]


def _grouped_mm_translation(opset: int) -> Callable[..., Any]:
    op = getattr(importlib.import_module("onnxscript"), f"opset{opset}")

    def grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:  # noqa: A002 (torch's schema names it so)
        experts = weight.shape[0]
        if not isinstance(experts, int):
            raise ValueError("transformers::grouped_mm_fallback: the expert count (weight.shape[0]) must be static "
                             "to export; it is symbolic here")
        axis0 = op.Constant(value_ints=[0])
        one = op.Constant(value_int=1)
        ends = op.Cast(offs, to=TensorProto.INT64)
        ends = op.Split(ends, axis=0, num_outputs=experts) if experts > 1 else (ends,)
        weights = op.Split(weight, axis=0, num_outputs=experts) if experts > 1 else (weight,)
        start = op.Constant(value_int=0)
        blocks = []
        for e in range(experts):
            end = op.Squeeze(ends[e], axis0)
            rows = op.Gather(input, op.Range(start, end, one), axis=0)
            blocks.append(op.MatMul(rows, op.Squeeze(weights[e], axis0)))
            start = end
        total = op.Squeeze(op.Shape(input, start=0, end=1), axis0)
        tail_rows = op.Unsqueeze(op.Sub(total, start), axis0)
        tail_shape = op.Concat(tail_rows, op.Shape(weight, start=2, end=3), axis=0)
        blocks.append(op.CastLike(op.ConstantOfShape(tail_shape), input))
        return op.Concat(*blocks, axis=0)

    return grouped_mm_fallback


def _stable_sort_translation(opset: int) -> Callable[..., Any]:
    op = getattr(importlib.import_module("onnxscript"), f"opset{opset}")

    def sort_stable(self: Any, stable: bool | None = None, dim: int = -1, descending: bool = False) -> Any:
        del stable  # onnxruntime's TopK is stable whatever the flag asks
        axis = dim % len(self.shape)
        size = op.Shape(self, start=axis, end=axis + 1)
        return op.TopK(self, size, axis=axis, largest=int(descending), sorted=1)

    return sort_stable


def extra_translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """Return the translations of the module docstring (transformers' op only once transformers registered it).

    Args:
        opset: The export's ONNX opset (the translations use the matching onnxscript opset module).

    Returns:
        ``{aten.sort.stable: ..., torch.ops.transformers.grouped_mm_fallback.default: ...}``.
    """
    table: dict[Any, Callable[..., Any]] = {torch.ops.aten.sort.stable: _stable_sort_translation(opset)}
    namespace = torch.ops.transformers
    if hasattr(namespace, "grouped_mm_fallback"):
        table[namespace.grouped_mm_fallback.default] = _grouped_mm_translation(opset)
    return table
