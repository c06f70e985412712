"""ONNX post-pass: look up embedding rows in the quantized table, then dequantize only the rows gathered.

An ``nn.Embedding`` with a quantized weight exports as ``DequantizeLinear(W_q) -> Gather(indices)``. onnxruntime
never constant-folds a ``DequantizeLinear`` (it keeps them for its QDQ fusions), so every run dequantizes the
whole ``[vocab, dim]`` table to read ``batch × seq`` rows of it: 61 µs per run for a 1000 × 256 table, and
milliseconds for a BERT-sized 30522 × 384 one. Dequantizing is elementwise, so gathering first gives the same
floats::

    per-tensor scale:        Gather(W_q, idx) -> DequantizeLinear(scale, zero_point)
    per-row scale (axis 0):  Cast(Gather(W_q, idx)) [- Unsqueeze(Cast(Gather(zp, idx)))] * Unsqueeze(Gather(s, idx))
    per-column (axis 1):     Gather(W_q, idx) -> DequantizeLinear(scale, zero_point, axis=-1)

``DequantizeLinear`` computes ``(q - zero_point) * scale`` with one float rounding, as the per-row form does
(``q - zero_point`` is an exact small integer in float), so the values are bit-identical. Tables read by other
ops too (tied input/output embeddings) keep their ``DequantizeLinear`` for those readers.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, readers_of

__all__ = ["gather_quantized_rows"]

#: Integer table types onnxruntime's Gather handles (4-bit types are packed two per byte, so they are left alone).
_GATHERABLE = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})


def _rewrite(
    graph: onnx.GraphProto, dq: onnx.NodeProto, gather: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]
) -> list[onnx.NodeProto] | None:
    """Nodes replacing ``gather`` (reading ``dq``'s output), or None when the pattern does not apply."""
    table = initializers[dq.input[0]]
    scale = initializers.get(dq.input[1])
    zero_point = initializers.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if scale is None or (len(dq.input) > 2 and dq.input[2] and zero_point is None):
        return None
    if len(table.dims) != 2 or table.data_type not in _GATHERABLE or int(attributes_of(dq).get("block_size", 0)):
        return None
    if gather.input[0] != dq.output[0] or int(attributes_of(gather).get("axis", 0)) != 0:
        return None
    prefix = f"{gather.name or gather.output[0]}_rows"
    indices, out = gather.input[1], gather.output[0]
    rows_q = f"{prefix}_quantized"
    nodes = [helper.make_node("Gather", [dq.input[0], indices], [rows_q], name=f"{prefix}_gather", axis=0)]
    per_tensor = int(np.prod(scale.dims)) == 1
    axis = int(attributes_of(dq).get("axis", 1)) % 2
    if per_tensor or axis == 1:
        nodes.append(helper.make_node("DequantizeLinear", [rows_q, *dq.input[1:]], [out], name=f"{prefix}_dequantize",
                                      axis=-1))
        return nodes
    # per-row scale: gather the row's scale (and zero point) with the row, dequantize by hand
    last = f"{prefix}_last_axis"
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), last))
    rows_f, scales, scales_col = f"{prefix}_float", f"{prefix}_scale", f"{prefix}_scale_column"
    nodes += [
        helper.make_node("Cast", [rows_q], [rows_f], name=f"{prefix}_cast", to=scale.data_type),
        helper.make_node("Gather", [dq.input[1], indices], [scales], name=f"{prefix}_gather_scale", axis=0),
        helper.make_node("Unsqueeze", [scales, last], [scales_col], name=f"{prefix}_scale_column"),
    ]
    if zero_point is not None and np.any(numpy_helper.to_array(zero_point)):
        zps, zps_f, zps_col, centered = (f"{prefix}_zero_point{s}" for s in ("", "_float", "_column", "_centered"))
        nodes += [
            helper.make_node("Gather", [dq.input[2], indices], [zps], name=f"{prefix}_gather_zero_point", axis=0),
            helper.make_node("Cast", [zps], [zps_f], name=f"{prefix}_cast_zero_point", to=scale.data_type),
            helper.make_node("Unsqueeze", [zps_f, last], [zps_col], name=f"{prefix}_zero_point_column"),
            helper.make_node("Sub", [rows_f, zps_col], [centered], name=f"{prefix}_center"),
        ]
        rows_f = centered
    nodes.append(helper.make_node("Mul", [rows_f, scales_col], [out], name=f"{prefix}_scale_rows"))
    return nodes


def gather_quantized_rows(model: onnx.ModelProto) -> int:
    """Rewrite ``DequantizeLinear(constant table) -> Gather(axis=0)`` into gather-then-dequantize, in place.

    Args:
        model: The exported model (main graph).

    Returns:
        The number of ``Gather`` nodes rewritten.
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers = readers_of(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    emptied: set[int] = set()
    graph_outputs = {o.name for o in graph.output}
    for dq in graph.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in initializers:
            continue
        users = readers.get(dq.output[0], [])
        rewritten = 0
        for user in users:
            if user.op_type == "Gather" and (nodes := _rewrite(graph, dq, user, initializers)) is not None:
                replaced[id(user)] = nodes
                rewritten += 1
        if users and rewritten == len(users) and dq.output[0] not in graph_outputs:
            emptied.add(id(dq))
    if not replaced:
        return 0
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in emptied:
            continue
        rebuilt.extend(replaced.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(rebuilt)
    return len(replaced)
