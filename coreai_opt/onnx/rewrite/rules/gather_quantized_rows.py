"""Rule: look up embedding rows in the quantized table, then dequantize only the rows gathered.

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

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["GatherQuantizedRows"]

#: Integer table types onnxruntime's Gather handles (4-bit types are packed two per byte, so they are left alone).
_GATHERABLE = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})


@dataclass(frozen=True)
class _Site(Match):
    view: QdqView
    gathers: tuple[onnx.NodeProto, ...]
    all_readers: bool  # every reader of the dequantized table is rewritten: the DequantizeLinear goes


class GatherQuantizedRows(Rule):
    """Rewrite ``DequantizeLinear(constant table) -> Gather(axis=0)`` into gather-then-dequantize (docstring)."""

    name = "gather_quantized_rows"
    anchors = frozenset({"DequantizeLinear"})
    #: As before the rule framework (the export stays byte-identical): an all-zero per-row zero point, unused once
    #: the rows are dequantized by hand, stays in the file (50 bytes for a 50-row table; removing it is a follow-up).

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A constant table's ``DequantizeLinear`` read by at least one ``Gather``."""
        view = QdqView.of(node, graph)
        if view is None or graph.initializer(view.data) is None:
            return None
        readers = graph.readers(node.output[0])
        if not any(r.op_type == "Gather" for r in readers):
            return None
        table = graph.initializer(view.data)
        if not view.has_constant_qparams:
            return Fail("table scale or zero point is not a constant")
        if len(table.dims) != 2 or table.data_type not in _GATHERABLE:
            return Fail(f"table is {view.type_name} of rank {len(table.dims)} (Gather reads 2-D 8/16-bit tables)")
        if view.block_size:
            return Fail("table is per-block")
        gathers = tuple(r for r in readers if r.op_type == "Gather" and r.input[0] == node.output[0]
                        and int(attributes_of(r).get("axis", 0)) == 0)
        if not gathers:
            return Fail("the Gather reads along an axis other than 0 (rows)")
        all_readers = len(gathers) == len(readers) and node.output[0] not in graph.outputs
        return _Site(node, view, gathers, all_readers)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Replace each ``Gather`` by gather-then-dequantize; drop the ``DequantizeLinear`` if nothing else reads it."""
        for gather in match.gathers:
            graph.replace(gather, _gather_then_dequantize(match.view, gather, graph))
        if match.all_readers:
            graph.remove(match.node)


def _gather_then_dequantize(view: QdqView, gather: onnx.NodeProto, graph: OnnxGraph) -> list[onnx.NodeProto]:
    """The nodes computing ``gather``'s output from the quantized table."""
    dq = view.node
    prefix = f"{gather.name or gather.output[0]}_rows"
    indices, out = gather.input[1], gather.output[0]
    rows_q = graph.unique_name(f"{prefix}_quantized")
    nodes = [helper.make_node("Gather", [view.data, indices], [rows_q], name=f"{prefix}_gather", axis=0)]
    if view.granularity == "per_tensor" or view.axis % 2 == 1:
        nodes.append(helper.make_node("DequantizeLinear", [rows_q, *dq.input[1:]], [out], name=f"{prefix}_dequantize",
                                      axis=-1))
        return nodes
    # per-row scale: gather the row's scale (and zero point) with the row, dequantize by hand
    float_type = int(helper.np_dtype_to_tensor_dtype(view.scale.dtype))
    last = graph.add_initializer(graph.unique_name(f"{prefix}_last_axis"), np.array([-1], np.int64))
    rows_f, scales, scales_col = (graph.unique_name(f"{prefix}_{s}") for s in ("float", "scale", "scale_column"))
    nodes += [
        helper.make_node("Cast", [rows_q], [rows_f], name=f"{prefix}_cast", to=float_type),
        helper.make_node("Gather", [view.scale_name, indices], [scales], name=f"{prefix}_gather_scale", axis=0),
        helper.make_node("Unsqueeze", [scales, last], [scales_col], name=f"{prefix}_scale_column"),
    ]
    if not view.zero_point_is_zero:
        zps, zps_f, zps_col, centered = (graph.unique_name(f"{prefix}_zero_point{s}")
                                         for s in ("", "_float", "_column", "_centered"))
        nodes += [
            helper.make_node("Gather", [view.zero_point_name, indices], [zps], name=f"{prefix}_gather_zero_point",
                             axis=0),
            helper.make_node("Cast", [zps], [zps_f], name=f"{prefix}_cast_zero_point", to=float_type),
            helper.make_node("Unsqueeze", [zps_f, last], [zps_col], name=f"{prefix}_zero_point_column"),
            helper.make_node("Sub", [rows_f, zps_col], [centered], name=f"{prefix}_center"),
        ]
        rows_f = centered
    nodes.append(helper.make_node("Mul", [rows_f, scales_col], [out], name=f"{prefix}_scale_rows"))
    return nodes
