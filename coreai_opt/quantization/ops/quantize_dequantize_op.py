"""The ``coreai_opt::quantize_dequantize`` custom op: eager kernel, fake kernel, STE autograd, ONNX translation.

Integer dtypes (``s``/``z`` broadcast along ``axis`` / ``block_size``)::

    q = clamp(round(x / s) + z, qmin, qmax)        # division, round half to even (same as ONNX)
    y = (q − z) · s

Float8: ``y = fp8(clamp(x / s, ±finfo.max)) · s`` (ONNX ``saturate=1``). Derived int32 bias (dtype
``"int32"``, ``z = 0``): ``y = clamp(round(x / s), qmin, qmax) · s``.

Broadcasting: a 0-d scale is per-tensor; with ``block_size == 0`` a 1-D scale runs along ``axis``
(per-channel) and a scale of the tensor's rank broadcasts as torch broadcasts (``PerAxes``: e.g.
``(1, heads, 1, head_dim)``; ONNX: the formula in elementwise ops, ``Cast(Clip(Round(x / s) + z))`` to the
integer type and back); with ``block_size > 0`` the scale has the tensor's rank and repeats
``block_size`` times along ``axis`` (ONNX opset-21 blocking). ``x`` and ``scale`` must be float32 (FakeQuantize
casts fp16/bf16).

Gradient (straight-through estimator): ``∂y/∂x = 1[qmin ≤ round(x / s) + z ≤ qmax]`` (0 where clamped;
float8: ``1[|x / s| ≤ finfo.max]``); no gradient flows to ``scale`` or ``zero_point``.

The ONNX translation emits ``QuantizeLinear → DequantizeLinear`` with a zero point cast to the quantized
type (the exporter folds the Cast into a typed initializer). The torch↔ONNX gaps are documented at each step
of :func:`_translate`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from onnx import TensorProto
from torch import Tensor

from coreai_opt.quantization.spec.dtypes import get_dtype_info

__all__ = ["quantize_dequantize", "quantize_dequantize_translation_table", "SUPPORTED_OPSETS", "INT32_FLOAT_BOUNDS",
           "BLOCKED_MIN_OPSET"]

#: ONNX opsets with a translation (the onnxscript opset module is chosen to match).
SUPPORTED_OPSETS: tuple[int, ...] = (18, 19, 20, 21, 22, 23)
#: ``block_size`` on QuantizeLinear / DequantizeLinear (per-block and per-token scales) exists from opset 21.
BLOCKED_MIN_OPSET: int = 21

#: Float32-representable clamp bounds of the int32 bias path: float32(2**31 - 1) rounds up to 2**31, which
#: would overflow the int32 Cast, so the largest float32 below 2**31 is used instead.
INT32_FLOAT_BOUNDS: tuple[float, float] = (-2147483648.0, 2147483520.0)


def _broadcast(qparam: Tensor, x: Tensor, axis: int, block_size: int) -> Tensor:
    """Broadcast a scale / zero point of ONNX qparam shape against ``x``."""
    if qparam.dim() == 0 or (block_size == 0 and qparam.dim() == x.dim() > 1):
        return qparam
    if block_size > 0:
        return qparam.repeat_interleave(block_size, dim=axis)
    return qparam.reshape([-1 if i == axis % x.dim() else 1 for i in range(x.dim())])


def _check_inputs(x: Tensor, scale: Tensor, dtype: str) -> None:
    if x.dtype != torch.float32 or scale.dtype != torch.float32:
        raise TypeError(
            f"coreai_opt::quantize_dequantize needs float32 x and scale, got x {x.dtype} and scale {scale.dtype}; "
            "cast to float32 first (FakeQuantize does this for fp16/bf16 inputs)"
        )
    get_dtype_info(dtype, allow_internal=True)


def _inside_range(x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int, quant_max: int,
                  axis: int, block_size: int, dtype: str) -> Tensor:
    """Boolean mask of the elements that are not clamped (the STE pass-through set)."""
    s = _broadcast(scale, x, axis, block_size)
    info = get_dtype_info(dtype, allow_internal=True)
    if info.is_float:
        return (x / s).abs() <= info.quant_max
    if dtype == "int32":
        lo, hi = _int32_bounds(quant_min, quant_max)
        q = torch.round(x / s)
        return (q >= lo) & (q <= hi)
    q = torch.round(x / s) + _broadcast(zero_point, x, axis, block_size)
    return (q >= quant_min) & (q <= quant_max)


def _int32_bounds(quant_min: int, quant_max: int) -> tuple[float, float]:
    return max(float(quant_min), INT32_FLOAT_BOUNDS[0]), min(float(quant_max), INT32_FLOAT_BOUNDS[1])


@torch.library.custom_op("coreai_opt::quantize_dequantize", mutates_args=())
def quantize_dequantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    quant_min: int,
    quant_max: int,
    axis: int,
    block_size: int,
    dtype: str,
) -> Tensor:
    """Fake-quantize ``x``: ``y = (clamp(round(x / s) + z, qmin, qmax) − z) · s`` (see the module docstring).

    Args:
        x: float32 input.
        scale: float32 scale of ONNX qparam shape (``()``, ``(C,)`` or blocked).
        zero_point: integer zero point of the same shape (ignored for float8 and int32).
        quant_min: Lowest quantized value (may be narrower than the dtype, e.g. -127 for int8).
        quant_max: Highest quantized value.
        axis: Channel / block axis (ignored for a 0-d scale).
        block_size: Block size along ``axis``; 0 unless per-block.
        dtype: Quantized dtype name (``"int8"``, ..., ``"float8_e5m2"``, or ``"int32"`` for biases).

    Returns:
        The fake-quantized tensor, same shape and dtype as ``x``.
    """
    _check_inputs(x, scale, dtype)
    if block_size > 0 and scale.dim() > 0:
        # Per block: on the (…, D/B, B, …) view the qparams broadcast along B instead of being repeated to the
        # size of x (two fewer x-sized temporaries); the same elementwise operations, so the same bits.
        a = axis % x.dim()
        blocked = _fake_quantize(x.unflatten(a, (-1, block_size)), scale.unsqueeze(a + 1),
                                 zero_point.unsqueeze(a + 1), quant_min, quant_max, dtype)
        return blocked.flatten(a, a + 1)
    return _fake_quantize(x, _broadcast(scale, x, axis, 0), _broadcast(zero_point, x, axis, 0), quant_min,
                          quant_max, dtype)


def _fake_quantize(x: Tensor, s: Tensor, z: Tensor, quant_min: int, quant_max: int, dtype: str) -> Tensor:
    """The op's formula with ``s`` and ``z`` already broadcastable against ``x``."""
    info = get_dtype_info(dtype, allow_internal=True)
    if info.is_float:
        fmax = float(info.quant_max)
        return (x / s).clamp(-fmax, fmax).to(info.storage_dtype).to(x.dtype) * s
    # One temporary the size of x, updated in place (a weight-sized fake quantization costs one copy, not three);
    # the same float32 operations in the same order as the out-of-place formula, so the same bits.
    q = torch.div(x, s).round_()
    if dtype == "int32":
        lo, hi = _int32_bounds(quant_min, quant_max)
        return q.clamp_(lo, hi).mul_(s)
    return q.add_(z).clamp_(quant_min, quant_max).sub_(z).mul_(s)


@quantize_dequantize.register_fake
def _quantize_dequantize_fake(x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int, quant_max: int,
                              axis: int, block_size: int, dtype: str) -> Tensor:
    _check_inputs(x, scale, dtype)
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, scale, zero_point, quant_min, quant_max, axis, block_size, dtype = inputs
    with torch.no_grad():
        ctx.save_for_backward(_inside_range(x, scale, zero_point, quant_min, quant_max, axis, block_size, dtype))


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    (mask,) = ctx.saved_tensors
    return (grad * mask, None, None, None, None, None, None, None)


quantize_dequantize.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- ONNX
def _opset_module(opset: int) -> Any:
    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"opset {opset} is not supported by coreai_opt::quantize_dequantize; use one of "
                         f"{SUPPORTED_OPSETS}")
    return getattr(importlib.import_module("onnxscript"), f"opset{opset}")


def _check_expressible(opset: int, dtype: str, block_size: int) -> None:
    info = get_dtype_info(dtype, allow_internal=True)
    if opset < info.min_opset:
        raise ValueError(
            f"dtype {dtype!r} needs ONNX opset >= {info.min_opset} (onnxruntime has no QuantizeLinear kernel for it "
            f"below), got opset {opset}; export with opset={max(info.min_opset, 21)}"
        )
    if block_size > 0 and opset < BLOCKED_MIN_OPSET:
        raise ValueError(f"per-block quantization (block_size={block_size}) needs ONNX opset >= {BLOCKED_MIN_OPSET}, "
                         f"got opset {opset}")


def _bound_like_x(op: Any, bound: Any, x: Any, scale: Any, axis: int, block_size: int) -> Any:
    """Reshape a qparam-shaped bound so it broadcasts against ``x`` (ONNX has no implicit axis broadcast)."""
    rank = len(x.shape)
    axis = axis % rank
    if len(scale.shape) == 0:
        return bound
    if block_size <= 0:
        shape = [1] * rank
        shape[axis] = -1
        return op.Reshape(bound, op.Constant(value_ints=shape))
    # Blocked: (…, D/B, …) → (…, D/B, 1, …) → (…, D/B, B, …) → shape of x. Written with Shape ops so that it
    # also works for symbolic dims; for constant qparams and static x the exporter folds it to a constant.
    expanded = op.Concat(
        op.Shape(bound, start=0, end=axis + 1),
        op.Constant(value_ints=[block_size]),
        op.Shape(bound, start=axis + 1),
        axis=0,
    )
    unsq = op.Unsqueeze(bound, op.Constant(value_ints=[axis + 1]))
    return op.Reshape(op.Expand(unsq, expanded), op.Shape(x))


def _translate(op: Any, opset: int, x: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int,
               axis: int, block_size: int, dtype: str) -> Any:
    broadcast = block_size == 0 and len(scale.shape) == len(x.shape) > 1
    _check_expressible(opset, dtype, block_size)
    info = get_dtype_info(dtype, allow_internal=True)
    per_tensor = len(scale.shape) == 0
    attrs: dict[str, int] = {} if per_tensor else {"axis": axis % len(x.shape)}
    if block_size > 0:
        attrs["block_size"] = block_size
    if broadcast and (info.is_float or dtype == "int32"):
        raise ValueError(f"a scale broadcast over several axes (PerAxes) is written for integer dtypes up to 16 bits, "
                         f"got dtype {dtype!r}; use PerChannel / PerTensor for it")
    if broadcast:
        # Gap: QuantizeLinear has no multi-axis scale, and onnxruntime 1.32's transpose optimizer breaks a blocked
        # (block_size 1) QuantizeLinear of a Transpose (it moves the Transpose, not the scale: "x_scale and x must
        # have the same shape"). The op's own formula in elementwise ops, with the scale broadcast: the same
        # float32 operations as eager, so the same bits; the codes are an explicit Cast to the integer type.
        zf = op.Cast(zero_point, to=TensorProto.FLOAT)
        q = op.Clip(op.Add(op.Round(op.Div(x, scale)), zf), op.Constant(value_float=float(quant_min)),
                    op.Constant(value_float=float(quant_max)))
        codes = op.Cast(q, to=info.onnx_type)
        return op.Mul(op.Sub(op.Cast(codes, to=TensorProto.FLOAT), zf), scale)
    if dtype == "int32":
        # Gap: QuantizeLinear has no INT32 output. Quantize by hand (Div + Round = torch's round-half-even of
        # x / s), clip to float32-exact int32 bounds so the Cast cannot overflow, then DequantizeLinear.
        lo, hi = _int32_bounds(quant_min, quant_max)
        q = op.Clip(op.Round(op.Div(x, scale)), op.Constant(value_float=lo), op.Constant(value_float=hi))
        return op.DequantizeLinear(op.Cast(q, to=TensorProto.INT32), scale, **attrs)
    # Gap: torch keeps the zero point as int32 (float8: an unused zero tensor); ONNX needs it typed as the
    # quantized element type, which also selects QuantizeLinear's output type (opset 19/20 have no
    # output_dtype attribute). The exporter's optimizer folds this Cast into a typed initializer.
    zp = op.Cast(zero_point, to=info.onnx_type)
    y = op.DequantizeLinear(op.QuantizeLinear(x, scale, zp, **attrs), scale, zp, **attrs)
    if info.is_float or (quant_min <= info.quant_min and quant_max >= info.quant_max):
        return y
    # Gap: QuantizeLinear saturates to the full dtype range; a narrower [qmin, qmax] (e.g. int8 [-127, 127])
    # needs an explicit clamp. It is applied after DequantizeLinear in the float domain against
    # (qmin − z)·s and (qmax − z)·s, which is exact: DequantizeLinear computes (q − z)·s with the same float32
    # multiply and is monotone in q. (Clip in the quantized domain has no onnxruntime kernel for int4/int16.)
    zf = op.Cast(zero_point, to=TensorProto.FLOAT)
    lo = op.Mul(op.Sub(op.Constant(value_float=float(quant_min)), zf), scale)
    hi = op.Mul(op.Sub(op.Constant(value_float=float(quant_max)), zf), scale)
    lo = _bound_like_x(op, lo, x, scale, axis, block_size)
    hi = _bound_like_x(op, hi, x, scale, axis, block_size)
    return op.Min(op.Max(y, lo), hi)


def quantize_dequantize_translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """Return the ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True, opset_version=opset)``.

    Args:
        opset: Target ONNX opset, one of :data:`SUPPORTED_OPSETS`. The translation uses the matching
            onnxscript opset module (an opset-21 translation cannot be exported at opset 19).

    Returns:
        ``{torch.ops.coreai_opt.quantize_dequantize.default: translation}``. The translation raises
        ``ValueError`` during export for a dtype or a per-block granularity the opset cannot express, naming the
        minimum opset.
    """
    op = _opset_module(opset)

    def quantize_dequantize_onnx(x: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int, axis: int,
                                 block_size: int, dtype: str) -> Any:
        return _translate(op, opset, x, scale, zero_point, quant_min, quant_max, axis, block_size, dtype)

    return {torch.ops.coreai_opt.quantize_dequantize.default: quantize_dequantize_onnx}
