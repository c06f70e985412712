"""Rule: store constant weights and biases quantized (integer / float8 initializer -> ``DequantizeLinear``).

The spec layer's translation emits ``QuantizeLinear -> DequantizeLinear`` for every quantizer, including the ones on
weights, and ``DequantizeLinear(Cast(Round(b / (s_in * s_w))))`` for int32 biases. When an input of a
``DequantizeLinear`` is computed from constants only, :class:`ConstantFolder` evaluates it once (with onnxruntime's
arithmetic) and the rule replaces it by one initializer of the quantized type (INT8, UINT8, INT16, UINT16, INT4,
UINT4, FLOAT8E4M3FN, FLOAT8E5M2, INT32; scale and zero point likewise). The float weights, now unused, are dropped,
so the file shrinks to about a quarter (int8) or an eighth (int4) of its fp32 size. Every ``DequantizeLinear``
reading the same value reads the one new initializer.

All-zero zero points of the blocked weights it folds (symmetric quantization) are dropped: the input is optional
and defaults to 0, and it would cost one value per block (onnxruntime's QGemm fusion needs the per-channel ones).

Narrow ranges (int8 ``[-127, 127]``): the translation clamps them in float after ``DequantizeLinear`` (``Clip``,
or ``Max -> Min`` for per-channel bounds). For a constant weight that clamp moves into the stored integers
(:mod:`~coreai_opt.onnx.rewrite.rules.narrow_range_clamp`), so onnxruntime sees ``DequantizeLinear -> Conv`` and can
fuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.constant_folder import INTEGER, ConstantFolder
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import axis_and_block
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule
from coreai_opt.onnx.rewrite.rules.narrow_range_clamp import ClampFold, plan_clamp_fold

__all__ = ["FoldQuantizedWeights"]


@dataclass(frozen=True)
class _Site(Match):
    folds: tuple[tuple[int, str, np.ndarray], ...]  # (input index, value name, its constant value)
    clamp: ClampFold | None
    drop_zero_point: bool


def _is_dequantize(node: onnx.NodeProto) -> bool:
    return node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx")


def _root_initializer(graph: OnnxGraph, name: str) -> str:
    """Follow first inputs upstream to the initializer a folded value was computed from (for naming)."""
    while graph.initializer(name) is None and (node := graph.producer(name)) is not None and node.input:
        name = node.input[0]
    return name


class FoldQuantizedWeights(Rule):
    """Fold the constant inputs of each ``DequantizeLinear`` into quantized initializers (module docstring)."""

    name = "fold_quantized_weights"
    anchors = frozenset({"DequantizeLinear"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``DequantizeLinear`` with a constant input that is not yet an initializer, or a foldable clamp."""
        if not _is_dequantize(node):
            return None
        folder = ConstantFolder(graph)
        folds, refusal = [], None
        for index, name in enumerate(node.input):
            if name and graph.initializer(name) is None and (value := folder.value(name)) is not None:
                folds.append((index, name, value))
            if index == 0:
                refusal = folder.refusal
        data = folds[0][2] if folds and folds[0][0] == 0 else graph.constant(node.input[0])
        if data is None:
            if folds:
                return _Site(node, tuple(folds), None, False)
            return Fail(f"weight not folded: {refusal}") if refusal else None
        scale = folder.value(node.input[1])
        zero_point = folder.value(node.input[2]) if len(node.input) > 2 else None
        data_folded = bool(folds) and folds[0][0] == 0
        clamp = None
        if _data_readers_after_fold(node, graph, data_folded) == 1:
            clamp = plan_clamp_fold(node, graph, folder, data, scale, zero_point)
        if not folds and clamp is None:
            return None
        return _Site(node, tuple(folds), clamp, data_folded and _zero_point_droppable(node, zero_point))

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Add the folded initializers, rewire every ``DequantizeLinear`` reading them, move the clamp."""
        node = match.node
        clamp_stored = False
        for index, name, value in match.folds:
            if index == 0:
                root = _root_initializer(graph, name)
                base = f"{root}_quantized" if graph.initializer(root) is not None else name
                if match.clamp is not None and graph.only_reader(name) is node:  # store the clamped integers
                    value, clamp_stored = match.clamp.stored, True  # at once (not a second large initializer)
            else:  # named after the (folded) data input it scales: "conv.bias_quantized_scale"
                base = f"{node.input[0]}_{'scale' if index == 1 else 'zero_point'}"
            folded = graph.add_initializer(graph.unique_name(base), value)
            for reader in graph.readers(name):
                if _is_dequantize(reader):
                    for slot, used in enumerate(reader.input):
                        if used == name:
                            graph.set_input(reader, slot, folded)
            if index == 0 and name in graph.precomputed:  # stored now: the large integers are not needed again
                del graph.precomputed[name]
        if match.clamp is not None:
            if not clamp_stored:
                graph.set_initializer(node.input[0], match.clamp.stored)
            for clamp_node in match.clamp.chain:
                graph.remove(clamp_node)
            graph.set_output(node, 0, match.clamp.chain[-1].output[0])
        if match.drop_zero_point:
            graph.remove_input(node, 2)


def _data_readers_after_fold(node: onnx.NodeProto, graph: OnnxGraph, folded: bool) -> int:
    """How many input slots will read the node's data once the folds are applied (only DQ readers are rewired)."""
    readers = graph.readers(node.input[0])  # one entry per input slot
    return sum(_is_dequantize(reader) for reader in readers) if folded else len(readers)


def _zero_point_droppable(node: onnx.NodeProto, zero_point: np.ndarray | None) -> bool:
    """A blocked weight's zero point that is an all-zero integer constant (the input defaults to 0)."""
    if len(node.input) < 3 or not node.input[2] or not axis_and_block(node)[1] or zero_point is None:
        return False
    return zero_point.dtype in INTEGER and not np.any(zero_point.astype(np.int64))
