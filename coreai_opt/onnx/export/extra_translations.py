"""ONNX translations torch's exporter lacks: transformers' grouped matmul, the stable sort and ``erfinv``.

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

**``erfinv``** (``aten.erfinv``, decomposed to ``prims.erf_inv``): ONNX has no inverse error function, and hf
Gemma-3n computes its activation-sparsity cutoff as ``Normal(0, 1).icdf(p) = sqrt(2) · erfinv(2p - 1)``. Written
as M. Giles' single-precision approximation ("Approximating the erfinv function", GPU Computing Gems, 2010)::

    w = -log((1 - x)(1 + x));  w < 5: p = P1(w - 2.5), else p = P2(sqrt(w) - 3);  erfinv(x) = p · x

(two degree-8 polynomials, both computed, ``Where`` picks one; relative error below 4e-7 of float32 over
(-1, 1), ±inf at ±1 as torch).
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


#: Giles' coefficients, highest degree first: P1 for w < 5 (around 2.5), P2 for the tails (around sqrt(w) = 3).
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                0.00943887047, 1.00167406, 2.83297682)


def _erfinv_translation(opset: int) -> Callable[..., Any]:
    op = getattr(importlib.import_module("onnxscript"), f"opset{opset}")

    def horner(coefficients: tuple[float, ...], w: Any) -> Any:
        p = op.CastLike(op.Constant(value_float=coefficients[0]), w)
        for c in coefficients[1:]:
            p = op.Add(op.Mul(p, w), op.CastLike(op.Constant(value_float=c), w))
        return p

    def erfinv(self: Any) -> Any:
        one = op.CastLike(op.Constant(value_float=1.0), self)
        w = op.Neg(op.Log(op.Mul(op.Sub(one, self), op.Add(one, self))))
        five = op.CastLike(op.Constant(value_float=5.0), self)
        central = horner(_ERFINV_CENTRAL, op.Sub(w, op.CastLike(op.Constant(value_float=2.5), self)))
        tail = horner(_ERFINV_TAIL, op.Sub(op.Sqrt(w), op.CastLike(op.Constant(value_float=3.0), self)))
        inf = op.CastLike(op.Constant(value_float=float("inf")), self)
        estimate = op.Mul(op.Where(op.Less(w, five), central, tail), self)
        return op.Where(op.Equal(op.Abs(self), one), op.Mul(self, inf), estimate)  # ±1 -> ±inf, as torch

    return erfinv


def extra_translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """Return the translations of the module docstring (transformers' op only once transformers registered it).

    Args:
        opset: The export's ONNX opset (the translations use the matching onnxscript opset module).

    Returns:
        ``{aten.sort.stable: ..., aten.erfinv / prims.erf_inv: ...,
        torch.ops.transformers.grouped_mm_fallback.default: ...}``.
    """
    erfinv = _erfinv_translation(opset)
    table: dict[Any, Callable[..., Any]] = {
        torch.ops.aten.sort.stable: _stable_sort_translation(opset),
        torch.ops.aten.erfinv.default: erfinv,
        torch.ops.prims.erf_inv.default: erfinv,
    }
    namespace = torch.ops.transformers
    if hasattr(namespace, "grouped_mm_fallback"):
        table[namespace.grouped_mm_fallback.default] = _grouped_mm_translation(opset)
    return table
