"""A constant ``DequantizeLinear`` weight as ``MatMulNBits`` inputs: the decisions of the MatMulNBits rule.

The export writes every weight-only linear ``MatMul(A, DQ(W))`` (and an int8-compute ``Gemm``) as onnxruntime's
``com.microsoft.MatMulNBits`` with an explicit ``accuracy_level``
(:mod:`coreai_opt.quantization.spec.matmul_compute`), so onnxruntime's own ``DQ → MatMul`` fusion (accuracy
level 4, int8 activations) never applies to a model that asked for float compute. This module is the part of
that rule that does not touch the graph: given the ``DequantizeLinear``'s constants it says why the weight cannot
be written (a near-miss reason) or returns the packed inputs.

The weight ``W`` is ``[K, N]`` (``MatMul``'s ``B``) or ``[N, K]`` (behind a ``Transpose``, or ``Gemm`` with
``transB=1``). Its scale (and zero point) is read once per ``MatMulNBits`` block, at the block's first element
along ``K`` (never expanded to ``W``'s shape: for a 32000 x 2048 head that was a float32 and an int64 copy of the
weight, issue 32): a blocked weight keeps its block (blocks must run along ``K``); a per-output-channel or
per-tensor one gets the block of :func:`~coreai_opt.quantization.spec.matmul_compute.matmul_nbits_block_size`.
The dequantized weight is bit-identical (``(q − z) · s`` with the same float32 scale per element).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN
from coreai_opt.quantization.matmul_nbits.packing import PackedMatMulNBits, pack_matmul_nbits
from coreai_opt.quantization.spec.matmul_compute import (
    block_size_problem,
    get_matmul_compute,
    matmul_nbits_block_size,
)

__all__ = ["WeightDQ", "INT8_EMULATED_SUFFIX", "pack_weight", "matmul_nbits_node"]

#: Name suffix of the int8-compute ``MatMulNBits`` nodes this export writes (their input quantization is emulated
#: by the eager model; :mod:`coreai_opt.onnx.verify.ort_kernels` reads it).
INT8_EMULATED_SUFFIX = "_int8_emulated"

# ONNX element type -> (bits, signed) of the weights MatMulNBits stores.
_WEIGHT_TYPES = {TensorProto.INT8: (8, True), TensorProto.UINT8: (8, False), TensorProto.INT4: (4, True),
                 TensorProto.UINT4: (4, False)}


@dataclass(frozen=True)
class WeightDQ:
    """The constants of one weight ``DequantizeLinear``.

    Attributes:
        data: The quantized 2-D weight (integer values).
        elem_type: Its ONNX element type.
        scale: The scale constant.
        zero_point: The zero point constant, None when absent.
        axis: ``axis`` attribute (default 1).
        block_size: ``block_size`` attribute (0: not blocked).
        transposed: True when ``data`` is ``[N, K]``, False for ``[K, N]``.
    """

    data: np.ndarray
    elem_type: int
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int
    block_size: int
    transposed: bool


def _per_block(value: np.ndarray, shape: tuple[int, int], axis: int, block_size: int, k_axis: int,
               block: int) -> np.ndarray:
    """``value`` (a DQ scale or zero point) at every ``block``-th element along ``K``, as ``[N, ceil(K / block)]``.

    Equals the value expanded to ``shape`` (``np.repeat`` by ``block_size`` along ``axis``, or broadcast) and read
    at ``K`` indices ``0, block, 2·block, ...``, without building the expansion.
    """
    first = np.arange(0, shape[k_axis], block)
    if block_size > 0:  # blocked along axis == k_axis (checked by _block_of)
        sampled = np.take(value, first // block_size, axis=axis)
    else:
        reduced = (len(first), shape[1]) if k_axis == 0 else (shape[0], len(first))
        if value.size == 1:
            sampled = np.full(reduced, value.reshape(()), value.dtype)
        else:
            sampled = np.broadcast_to(value.reshape([-1, 1] if axis == 0 else [1, -1]), reduced)
    return np.ascontiguousarray(sampled if k_axis == 1 else sampled.T)


def _block_of(weight: WeightDQ, k: int, compute: str) -> int | str:
    """The MatMulNBits block size, or why there is none."""
    k_axis = 1 if weight.transposed else 0
    axis = weight.axis % 2
    if weight.block_size > 0 and axis != k_axis:
        return "weight blocks run along the output features, MatMulNBits blocks run along K"
    if weight.block_size == 0 and weight.scale.size > 1 and axis == k_axis:
        return "weight scale varies along the input features (per-input-channel), not per output channel"
    block = matmul_nbits_block_size(None, k, weight.block_size)
    return block_size_problem(block, compute) or block


def pack_weight(weight: WeightDQ, compute: str, marker_block: int | None = None) -> PackedMatMulNBits | str:
    """Pack ``weight`` for ``MatMulNBits`` (module docstring), or return the near-miss reason.

    Args:
        weight: The ``DequantizeLinear`` constants.
        compute: ``"float"`` or ``"int8"`` (a ``matmul_compute`` key).
        marker_block: For int8 compute, the block size the eager model quantized the input with.
    """
    if weight.elem_type not in _WEIGHT_TYPES:
        name = helper.tensor_dtype_to_string(weight.elem_type).removeprefix("TensorProto.")
        return f"weight type {name} has no MatMulNBits form (int4 / uint4 / int8 / uint8)"
    if weight.data.ndim != 2:
        return f"weight has rank {weight.data.ndim}, MatMulNBits needs a 2-D weight"
    if weight.scale.dtype != np.float32:
        return f"weight scale is {weight.scale.dtype}, MatMulNBits is written for float32 activations here"
    bits, signed = _WEIGHT_TYPES[weight.elem_type]
    q = weight.data if weight.transposed else weight.data.T
    n, k = q.shape
    block = _block_of(weight, k, compute)
    if isinstance(block, str):
        return block
    if get_matmul_compute(compute).quantizes_activation and marker_block != block:
        return (f"the eager model quantized the input in blocks of {marker_block}, the weight is written in blocks "
                f"of {block}")
    shape, axis, k_axis = weight.data.shape, weight.axis % 2, 1 if weight.transposed else 0
    scale = _per_block(weight.scale, shape, axis, weight.block_size, k_axis, block)
    zero = None if weight.zero_point is None else _per_block(weight.zero_point.astype(np.int64), shape, axis,
                                                             weight.block_size, k_axis, block)
    return pack_matmul_nbits(q, scale, zero, bits, signed, block)


def matmul_nbits_node(packed: PackedMatMulNBits, a: str, names: tuple[str, str, str | None], output: str,
                      node_name: str, compute: str) -> onnx.NodeProto:
    """The ``MatMulNBits`` node reading ``a`` and the packed initializers ``names`` (B, scales, zero points)."""
    entry = get_matmul_compute(compute)
    b, scales, zero_points = names
    inputs = [a, b, scales] + ([zero_points] if zero_points else [])
    name = node_name + (INT8_EMULATED_SUFFIX if entry.quantizes_activation else "")
    return helper.make_node("MatMulNBits", inputs, [output], name=name, domain=CONTRIB_DOMAIN, K=packed.k,
                            N=packed.n, bits=packed.bits, block_size=packed.block_size,
                            accuracy_level=entry.accuracy_level)
