"""The ``coreai_opt::dynamic_quantize_dequantize`` custom op: per-tensor dynamic uint8 fake quantization.

Eager math is the ONNX ``DynamicQuantizeLinear → DequantizeLinear`` pair, computed the way onnxruntime's CPU
kernels compute it (float32 throughout, checked bit-exact in ``tests/spec/test_dynamic_quantize_op.py``)::

    x_min = min(0, min(x))          x_max = max(0, max(x))            # the range always contains 0
    s     = (x_max − x_min) / 255                                     # qmin = 0, qmax = 255 (uint8)
    z     = round(clamp(0 − x_min / s, 0, 255))                       # round half to even
    q     = clamp(round(x / s) + z, 0, 255)                           # division, round half to even
    y     = (q − z) · s

An all-zero tensor would give ``s = 0``; onnxruntime then uses ``s = 1, z = 0`` (``y = 0``), and so does the eager op.

Why per-tensor: onnxruntime fuses ``DynamicQuantizeLinear → DequantizeLinear → MatMul`` with a
``DequantizeLinear``-ed int8 weight into its integer kernels (``MatMulIntegerToFloat`` /
``DynamicQuantizeMatMul``), the kernels ``quantize_dynamic`` uses. A per-token scale has no fused ONNX form.

Gradient: straight-through (``∂y/∂x = 1``); the dynamic range never clips.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DYNAMIC_QUANT_MAX",
    "dynamic_qparams",
    "dynamic_quantize_dequantize",
    "dynamic_quantize_dequantize_translation_table",
]

#: The uint8 range of ONNX ``DynamicQuantizeLinear``: ``[0, 255]``.
DYNAMIC_QUANT_MAX: int = 255


def dynamic_qparams(x: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(scale, zero_point)`` of ``DynamicQuantizeLinear`` for ``x``: float32 and int32 scalars.

    Formulas in the module docstring. ``x`` must be float32.
    """
    x_min = torch.clamp(x.min(), max=0.0)
    x_max = torch.clamp(x.max(), min=0.0)
    scale = (x_max - x_min) / float(DYNAMIC_QUANT_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero x: onnxruntime uses s = 1, z = 0
    zero_point = torch.round(torch.clamp(0.0 - x_min / scale, 0.0, float(DYNAMIC_QUANT_MAX)))
    return scale, zero_point.to(torch.int32)


def _check(x: Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(
            f"coreai_opt::dynamic_quantize_dequantize needs a float32 input, got {x.dtype}; cast to float32 first "
            "(DynamicFakeQuantize does this for fp16/bf16 inputs)"
        )


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
    scale, zero_point = dynamic_qparams(x)
    z = zero_point.to(torch.float32)
    q = torch.clamp(torch.round(x / scale) + z, 0.0, float(DYNAMIC_QUANT_MAX))
    return (q - z) * scale


@dynamic_quantize_dequantize.register_fake
def _dynamic_quantize_dequantize_fake(x: Tensor) -> Tensor:
    _check(x)
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    del ctx, inputs, output


def _backward(ctx: Any, grad: Tensor) -> Tensor:
    del ctx
    return grad


dynamic_quantize_dequantize.register_autograd(_backward, setup_context=_setup_context)


def dynamic_quantize_dequantize_translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """Return ``{torch.ops.coreai_opt.dynamic_quantize_dequantize.default: translation}`` for ``opset``.

    The translation emits ``DynamicQuantizeLinear → DequantizeLinear`` (both exist since opset 11). Merge it
    into the ``custom_translation_table`` of ``torch.onnx.export(dynamo=True, opset_version=opset)``.

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

    return {torch.ops.coreai_opt.dynamic_quantize_dequantize.default: dynamic_quantize_dequantize_onnx}
