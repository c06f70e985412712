"""Rule: store ``Transpose``-d constant weights already transposed, so ``DequantizeLinear`` feeds the MatMul.

The exporter writes ``nn.Linear`` on a 3-D input as ``MatMul(x, Transpose(W))`` with ``W`` of shape ``[N, K]``.
With quantized weights that is ``DequantizeLinear(W_q) -> Transpose -> MatMul``, and onnxruntime's fusions look
for ``DequantizeLinear -> MatMul`` with a ``[K, N]`` weight (e.g. blocked int4 -> ``MatMulNBits``). Transposing a
constant before or after dequantizing gives the same floats (DequantizeLinear is elementwise), so this rule stores
``W_q`` transposed, transposes a per-block scale / zero point the same way, moves the quantization axis
(``axis=a`` -> ``1 - a``), and drops the ``Transpose``.

Only 2-D constant weights whose ``DequantizeLinear`` output is read by that single ``Transpose(perm=[1, 0])`` are
rewritten; a blocked scale or zero point shared with other nodes (e.g. the identical layers of an
``nn.TransformerEncoder``, whose equal scales the exporter stores once) gets a transposed copy per weight. Every
weight is matched before any is rewritten, so "shared" means shared in the exported graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["FoldWeightTransposes"]


@dataclass(frozen=True)
class _Site(Match):
    transpose: onnx.NodeProto
    view: QdqView
    shared: frozenset[str]  # blocked scale / zero point read by other nodes too: transposed into a copy


class FoldWeightTransposes(Rule):
    """Fold ``DequantizeLinear(W_q) -> Transpose(perm=[1, 0])`` on constant 2-D weights into ``W_q`` (docstring)."""

    name = "fold_weight_transposes"
    anchors = frozenset({"DequantizeLinear"})
    #: As before the rule framework (the export stays byte-identical): what it leaves unused stays in the file.
    matches_first = True

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A constant weight's ``DequantizeLinear`` whose only reader is a ``Transpose``."""
        view = QdqView.of(node, graph)
        if view is None or graph.initializer(view.data) is None or graph.constant(view.data) is None:
            return None
        transpose = graph.only_reader(node.output[0])
        if transpose is None or transpose.op_type != "Transpose":
            return None
        perm = [int(p) for p in attributes_of(transpose).get("perm", [])]
        rank = len(graph.initializer(view.data).dims)
        if rank != 2 or perm != [1, 0]:
            return Fail(f"weight of rank {rank} transposed with perm={perm}, not a 2-D [1, 0] transpose")
        if not all(graph.initializer(name) is not None and graph.constant(name) is not None
                   for name in node.input[1:] if name):
            return Fail("scale or zero point is not a constant initializer")
        if len(graph.readers(view.data)) != 1:
            return Fail("the stored weight has other readers (it cannot be transposed for one of them)")
        shared = frozenset(name for name in node.input[1:] if name and len(graph.readers(name)) > 1)
        return _Site(node, transpose, view, shared)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Transpose the stored weight (and blocked qparams), flip the axis, drop the ``Transpose``."""
        node, view = match.node, match.view
        graph.set_initializer(view.data, np.ascontiguousarray(graph.constant(view.data).T))
        qparams = [name for name in node.input[1:] if name]
        for index, name in enumerate(qparams, start=1):
            value = graph.constant(name)
            if not view.block_size or value.ndim != 2:
                continue
            if name not in match.shared:
                graph.set_initializer(name, np.ascontiguousarray(value.T))
            else:  # shared: give this weight its own copy
                copy = graph.unique_name(f"{view.data}_{'scale' if index == 1 else 'zero_point'}_t")
                graph.add_initializer(copy, np.ascontiguousarray(value.T))
                graph.set_input(node, index, copy)
        if any(graph.constant(name).size > 1 for name in qparams):
            _set_axis(node, 1 - view.axis % 2)
        graph.remove(match.transpose)
        graph.set_output(node, 0, match.transpose.output[0])


def _set_axis(node: onnx.NodeProto, axis: int) -> None:
    for attr in node.attribute:
        if attr.name == "axis":
            attr.i = axis
            return
    node.attribute.append(helper.make_attribute("axis", axis))
