"""The ``coreai_opt::dynamic_quantize_dequantize`` custom ops: dynamic uint8 fake quantization, per tensor or per token.

Eager math is the ONNX ``DynamicQuantizeLinear → DequantizeLinear`` pair, computed the way onnxruntime's CPU
kernels compute it (float32 throughout, checked bit-exact in ``tests/spec/test_dynamic_quantize_op.py``)::

    x_min = min(0, min(x))          x_max = max(0, max(x))            # the range always contains 0
    s     = (x_max − x_min) / 255                                     # qmin = 0, qmax = 255 (uint8)
    z     = round(clamp(0 − x_min / s, 0, 255))                       # round half to even
    q     = clamp(round(x / s) + z, 0, 255)                           # division, round half to even
    y     = (q − z) · s

An all-zero tensor would give ``s = 0``; onnxruntime then uses ``s = 1, z = 0`` (``y = 0``), and so does the eager op.

Per tensor (``dynamic_quantize_dequantize``): onnxruntime fuses ``DynamicQuantizeLinear → DequantizeLinear →
MatMul`` with a ``DequantizeLinear``-ed int8 weight into its integer kernels (``MatMulIntegerToFloat`` /
``DynamicQuantizeMatMul``), the kernels ``quantize_dynamic`` uses.

Per token (``dynamic_quantize_dequantize_per_token``): the same formulas with ``min`` / ``max`` over the last axis
only, one ``(s, z)`` per row (a token of ``(batch, seq, hidden)``), so a row is rounded on the same grid whatever
else the call holds (a one-token KV-cache step and a full regeneration agree). An all-zero row gets ``s = 1, z = 0``.
No onnxruntime kernel takes a per-row activation scale (``DynamicQuantizeLinear`` / ``DynamicQuantizeMatMul`` are
per tensor; ``MatMulIntegerToFloat``'s ``a_scale`` is per tensor or per *column* of ``A``), so the export writes
the formulas as ONNX ops (opset >= 21 for the blocked ``QuantizeLinear``)::

    x_max = Max(ReduceMax(x, [-1], keepdims=1), 0)     x_min = Min(ReduceMin(x, [-1], keepdims=1), 0)
    s     = Where(d > 0, d, 1)  with  d = (x_max − x_min) / 255
    z     = Cast(Round(Clip(0 − x_min / s, 0, 255)), uint8)
    y     = DequantizeLinear(QuantizeLinear(x, s, z, axis=-1, block_size=K), s, z, axis=-1, block_size=K)

each op computing exactly the eager float32 expression (``QuantizeLinear``: ``round(x / s) + z``, saturated; checked
bit-exact in ``tests/spec/test_dynamic_quantize_op.py``). The rule ``dynamic_matmuls_to_integer`` turns the product
behind it into ``MatMulInteger``.

Gradient: straight-through (``∂y/∂x = 1``); the dynamic range never clips.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from coreai_opt.quantization.ops.quantize_dequantize_op import BLOCKED_MIN_OPSET

__all__ = [
    "DYNAMIC_QUANT_MAX",
    "dynamic_qparams",
    "dynamic_quantize_dequantize",
    "dynamic_quantize_dequantize_per_token",
    "dynamic_quantize_dequantize_translation_table",
]

#: The uint8 range of ONNX ``DynamicQuantizeLinear``: ``[0, 255]``.
DYNAMIC_QUANT_MAX: int = 255


def dynamic_qparams(x: Tensor, per_token: bool = False) -> tuple[Tensor, Tensor]:
    """Return ``(scale, zero_point)`` of ``DynamicQuantizeLinear`` for ``x``: float32 and int32.

    Formulas in the module docstring. ``x`` must be float32. Per tensor: scalars; per token: shape
    ``x.shape[:-1] + (1,)``, the range of each row of the last axis.
    """
    if per_token:
        x_min = torch.clamp(x.amin(dim=-1, keepdim=True), max=0.0)
        x_max = torch.clamp(x.amax(dim=-1, keepdim=True), min=0.0)
    else:
        x_min = torch.clamp(x.min(), max=0.0)
        x_max = torch.clamp(x.max(), min=0.0)
    scale = (x_max - x_min) / float(DYNAMIC_QUANT_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero x: onnxruntime uses s = 1, z = 0
    zero_point = torch.round(torch.clamp(0.0 - x_min / scale, 0.0, float(DYNAMIC_QUANT_MAX)))
    return scale, zero_point.to(torch.int32)


def _check(x: Tensor, op: str = "dynamic_quantize_dequantize") -> None:
    if x.dtype != torch.float32:
        raise TypeError(
            f"coreai_opt::{op} needs a float32 input, got {x.dtype}; cast to float32 first "
            "(DynamicFakeQuantize does this for fp16/bf16 inputs)"
        )


def _fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
    """``(clamp(round(x / s) + z, 0, 255) − z) · s`` in float32 (division, round half to even)."""
    z = zero_point.to(torch.float32)
    q = torch.clamp(torch.round(x / scale) + z, 0.0, float(DYNAMIC_QUANT_MAX))
    return (q - z) * scale


@torch.library.custom_op("coreai_opt::dynamic_quantize_dequantize", mutates_args=())
def dynamic_quantize_dequantize(x: Tensor) -> Tensor:
    """Fake-quantize ``x`` with per-tensor dynamic uint8 qparams (see the module docstring).

    Args:
        x: float32 tensor, any shape.

    Returns:
        ``(clamp(round(x / s) + z, 0, 255) − z) · s`` with ``(s, z) = dynamic_qparams(x)``; an empty ``x`` (no
        range to measure) gives an empty tensor.
    """
    _check(x)
    if x.numel() == 0:
        return torch.empty_like(x)
    return _fake_quantize(x, *dynamic_qparams(x))


@dynamic_quantize_dequantize.register_fake
def _dynamic_quantize_dequantize_fake(x: Tensor) -> Tensor:
    _check(x)
    return torch.empty_like(x)


_PER_TOKEN = "dynamic_quantize_dequantize_per_token"


def _check_per_token(x: Tensor) -> None:
    _check(x, _PER_TOKEN)
    if x.dim() == 0:
        raise ValueError(f"coreai_opt::{_PER_TOKEN} quantizes rows of the last axis and needs a tensor of rank >= 1, "
                         "got a scalar; use the per-tensor dynamic_quantize_dequantize")


@torch.library.custom_op(f"coreai_opt::{_PER_TOKEN}", mutates_args=())
def dynamic_quantize_dequantize_per_token(x: Tensor) -> Tensor:
    """Fake-quantize ``x`` with dynamic uint8 qparams per row of the last axis (see the module docstring).

    Args:
        x: float32 tensor of rank >= 1.

    Returns:
        ``(clamp(round(x / s) + z, 0, 255) − z) · s`` with ``(s, z) = dynamic_qparams(x, per_token=True)``
        broadcast along the last axis; an empty ``x`` gives an empty tensor.
    """
    _check_per_token(x)
    if x.numel() == 0:
        return torch.empty_like(x)
    return _fake_quantize(x, *dynamic_qparams(x, per_token=True))


@dynamic_quantize_dequantize_per_token.register_fake
def _dynamic_quantize_dequantize_per_token_fake(x: Tensor) -> Tensor:
    _check_per_token(x)
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    del ctx, inputs, output


def _backward(ctx: Any, grad: Tensor) -> Tensor:
    del ctx
    return grad


dynamic_quantize_dequantize.register_autograd(_backward, setup_context=_setup_context)
dynamic_quantize_dequantize_per_token.register_autograd(_backward, setup_context=_setup_context)

def dynamic_quantize_dequantize_translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """Return the translations of the per-tensor and (opset >= 21) per-token ops for ``opset``.

    Per tensor: ``DynamicQuantizeLinear → DequantizeLinear`` (both exist since opset 11); per token: the ops of
    the module docstring (its rows need a static last dimension). Merge the dict into the
    ``custom_translation_table`` of ``torch.onnx.export(dynamo=True, opset_version=opset)``.

    Raises:
        ValueError: ``opset`` below 11 or without an onnxscript opset module.
    """
    if opset < 11:
        raise ValueError(f"DynamicQuantizeLinear needs ONNX opset >= 11, got {opset}; export with opset >= 13")
    try:
        op = getattr(importlib.import_module("onnxscript"), f"opset{opset}")
    except AttributeError as exc:
        raise ValueError(f"onnxscript has no opset{opset} module; pick an opset onnxscript supports") from exc

    def dynamic_quantize_dequantize_onnx(x: Any) -> Any:
        q, scale, zero_point = op.DynamicQuantizeLinear(x)
        return op.DequantizeLinear(q, scale, zero_point)

    table: dict[Any, Callable[..., Any]] = {
        torch.ops.coreai_opt.dynamic_quantize_dequantize.default: dynamic_quantize_dequantize_onnx}
    if opset >= BLOCKED_MIN_OPSET:  # the per-token form is a blocked QuantizeLinear
        table[torch.ops.coreai_opt.dynamic_quantize_dequantize_per_token.default] = _per_token_translation(op)
    return table


def _per_token_translation(op: Any) -> Callable[..., Any]:
    from onnx import TensorProto

    def dynamic_quantize_dequantize_per_token_onnx(x: Any) -> Any:
        width = x.shape[-1] if x.shape is not None and len(x.shape) else None
        if not isinstance(width, int):
            raise ValueError(f"coreai_opt::{_PER_TOKEN} exports a QuantizeLinear blocked along the last axis, which "
                             f"needs a static last dimension; got shape {x.shape}. Keep the feature dimension static "
                             "(mark only batch / sequence dimensions dynamic)")
        zero, top = op.Constant(value_float=0.0), op.Constant(value_float=float(DYNAMIC_QUANT_MAX))
        last = op.Constant(value_ints=[-1])
        x_max = op.Max(op.ReduceMax(x, last, keepdims=1), zero)
        x_min = op.Min(op.ReduceMin(x, last, keepdims=1), zero)
        spread = op.Div(op.Sub(x_max, x_min), top)
        scale = op.Where(op.Greater(spread, zero), spread, op.Constant(value_float=1.0))
        zero_point = op.Cast(op.Round(op.Clip(op.Sub(zero, op.Div(x_min, scale)), zero, top)), to=TensorProto.UINT8)
        blocked = {"axis": -1, "block_size": width}
        q = op.QuantizeLinear(x, scale, zero_point, **blocked)
        return op.DequantizeLinear(q, scale, zero_point, **blocked)

    return dynamic_quantize_dequantize_per_token_onnx
