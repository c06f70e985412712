"""Move a narrow-range clamp after a constant ``DequantizeLinear`` into its stored integers.

The spec translation clamps narrow ranges (int8 ``[-127, 127]``) after ``DequantizeLinear``, in float: ``Clip(lo,
hi)``, or ``Max(lo) -> Min(hi)`` (either order) for per-channel bounds. That would keep onnxruntime from fusing
``DequantizeLinear -> Conv``. For a constant weight the clamp is applied to the stored integers instead,
``q' = clip(round(clamp(dq(q)) / s) + z)``, and kept only if ``dq(q')`` reproduces the clamped floats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx

from coreai_opt.onnx.rewrite.constant_folder import INTEGER, ConstantFolder, dequantize, expand_qparam
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import axis_and_block
from coreai_opt.onnx.rewrite.row_chunks import broadcast_rows, qparam_rows, row_ranges

__all__ = ["ClampFold", "plan_clamp_fold"]


@dataclass(frozen=True)
class ClampFold:
    """The clamp nodes to drop and the stored integers that replace them."""

    chain: tuple[onnx.NodeProto, ...]
    stored: np.ndarray


def _clamp_chain(node: onnx.NodeProto, graph: OnnxGraph,
                 folder: ConstantFolder) -> tuple[list[onnx.NodeProto], np.ndarray | None, np.ndarray | None] | None:
    """The ``Clip(lo, hi)`` or ``Max(lo) -> Min(hi)`` (either order) applied to the node's output alone."""
    chain: list[onnx.NodeProto] = []
    low = high = None
    current = node.output[0]
    while (user := graph.only_reader(current)) is not None and len(chain) < 2:
        if user.op_type == "Clip" and not chain and user.input[0] == current:
            names = list(user.input[1:3])
            bounds = [folder.value(name) if name else None for name in names] + [None] * (2 - len(names))
            if any(name and value is None for name, value in zip(names, bounds, strict=False)):
                return None
            return [user], bounds[0], bounds[1]
        if user.op_type not in ("Max", "Min") or len(user.input) != 2:
            break
        other = folder.value(user.input[1] if user.input[0] == current else user.input[0])
        if other is None or (user.op_type == "Max" and low is not None) or (user.op_type == "Min" and high is not None):
            break
        low, high = (other, high) if user.op_type == "Max" else (low, other)
        chain.append(user)
        current = user.output[0]
    return (chain, low, high) if chain else None


def plan_clamp_fold(node: onnx.NodeProto, graph: OnnxGraph, folder: ConstantFolder, q: np.ndarray,
                    scale: np.ndarray | None, zero_point: np.ndarray | None) -> ClampFold | None:
    """The clamp fold for the ``DequantizeLinear`` ``node`` of the integer constant ``q``, None if there is none.

    Args:
        node: The ``DequantizeLinear``.
        graph: Its graph.
        folder: Evaluates the clamp bounds.
        q: The stored integers (after folding).
        scale: Its scale (None: not a constant, nothing is folded).
        zero_point: Its zero point, None when absent.
    """
    if scale is None or q.dtype not in INTEGER:
        return None
    found = _clamp_chain(node, graph, folder)
    if found is None:
        return None
    chain, low, high = found
    axis, block_size = axis_and_block(node)
    if q.ndim == 0 or any(bound is not None and bound.ndim > q.ndim for bound in (low, high)):
        return _clamp_whole(node, chain, q, scale, zero_point, low, high)
    axis %= q.ndim
    stored = np.empty_like(q)
    for rows in row_ranges(q.shape, axis, block_size):  # row chunks: bounded temporaries, the same integers
        part = _clamp_whole(node, chain, q[rows], qparam_rows(scale, axis, block_size, rows),
                            qparam_rows(zero_point, axis, block_size, rows), broadcast_rows(low, q.ndim, rows),
                            broadcast_rows(high, q.ndim, rows))
        if part is None:
            return None
        stored[rows] = part.stored
    return ClampFold(tuple(chain), stored)


def _clamp_whole(node: onnx.NodeProto, chain: list[onnx.NodeProto], q: np.ndarray, scale: np.ndarray,
                 zero_point: np.ndarray | None, low: np.ndarray | None, high: np.ndarray | None) -> ClampFold | None:
    """The clamp fold of ``q`` in one piece: ``clip(round(clamp(dq(q)) / s) + z)``, None unless it is exact."""
    clamped = dequantize(node, q, scale, zero_point)
    if low is not None:
        clamped = np.maximum(clamped, low.astype(np.float32))
    if high is not None:
        clamped = np.minimum(clamped, high.astype(np.float32))
    axis, block_size = axis_and_block(node)
    s = expand_qparam(scale, q, axis, block_size).astype(np.float64)
    z = 0.0 if zero_point is None else expand_qparam(zero_point.astype(np.float64), q, axis, block_size)
    info = ml_dtypes.iinfo(q.dtype)
    stored = np.clip(np.rint(clamped.astype(np.float64) / s) + z, int(info.min), int(info.max)).astype(q.dtype)
    if not np.array_equal(dequantize(node, stored, scale, zero_point), clamped):
        return None
    return ClampFold(tuple(chain), stored)
