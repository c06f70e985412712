r"""Rule: keep onnxruntime from fusing ops around a 4-bit activation ``QuantizeLinear`` / ``DequantizeLinear``.

onnxruntime's QDQ optimizer (``ORT_ENABLE_EXTENDED`` and above) turns ``DQ -> Conv -> Q`` into ``QLinearConv``
(likewise ``QGemm``, ``QLinearMatMul``, ``QLinearAdd``, ...) without checking the quantized type; for int4/uint4
activations it builds a node it then rejects, and the session refuses the file:

    INVALID_GRAPH : Type 'tensor(uint4)' of input parameter ... of operator (QLinearConv) ... is invalid

Its QDQ propagation also moves a 4-bit ``DequantizeLinear`` past ``MaxPool`` / ``Reshape`` / ``Transpose``, which
then get 4-bit inputs they have no kernel for. The file itself is valid (it runs bit-exact with the optimizer off).
This rule puts ``Max(x, lowest float32)``, which no fusion or propagation pattern matches, on both sides of every
int4/uint4 *activation* quantizer: between the producing op and the ``QuantizeLinear`` (unless the producer is a
``DequantizeLinear`` or a ``Max``/``Min``, e.g. of :mod:`~coreai_opt.onnx.rewrite.rules.guard_float8_activations`) and
after the ``DequantizeLinear``. Weight ``DequantizeLinear`` nodes (stored inputs: ``MatMulNBits`` for int4 weights)
are left alone. No value changes: :math:`\max(x, -3.4\cdot10^{38}) = x` for every float except :math:`-\infty`,
which quantizes to ``qmin`` either way, and a ``DequantizeLinear`` output is always finite.

Every anchor is matched on the graph as it was before the rule ran (``matches_first``), and all guards read one
``four_bit_guard_lowest`` initializer. A ``DequantizeLinear`` already followed by its guard is not matched again.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["GuardFourBitActivations"]

_FOUR_BIT = frozenset({TensorProto.INT4, TensorProto.UINT4})
_UNFUSED_PRODUCERS = frozenset({"DequantizeLinear", "Max", "Min"})
_LOWEST = np.array(np.finfo(np.float32).min, dtype=np.float32)


def _is_guard(node: onnx.NodeProto, graph: OnnxGraph) -> bool:
    """``Max(x, lowest float32)``: a guard this rule put there."""
    if node.op_type != "Max" or len(node.input) != 2:
        return False
    bound = graph.constant(node.input[1])
    return bound is not None and bound.shape == () and bound == _LOWEST


class GuardFourBitActivations(Rule):
    """Put ``Max(x, lowest)`` on both sides of every int4/uint4 activation quantizer (see the module docstring)."""

    name = "guard_4bit_activations"
    anchors = frozenset({"QuantizeLinear", "DequantizeLinear"})
    #: As before the rule framework (the export stays byte-identical): what it leaves unused stays in the file.
    matches_first = True

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | Fail | None:
        """A 4-bit ``QuantizeLinear`` of a computed value, or a 4-bit ``DequantizeLinear`` of one."""
        view = QdqView.of(node, graph)
        if view is None or view.quant_type not in _FOUR_BIT:
            return None
        producer = graph.producer(view.data)
        if view.is_dequantize:
            if producer is None:
                return None  # a stored weight (MatMulNBits keeps its DequantizeLinear -> MatMul)
            readers = graph.readers(node.output[0])
            return None if readers and all(_is_guard(r, graph) for r in readers) else Match(node)
        if producer is None:
            if view.data in graph.inputs:
                return Fail("reads a graph input: no op in front of it to keep from fusing")
            return None  # a stored weight
        return None if producer.op_type in _UNFUSED_PRODUCERS else Match(node)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """``x -> Max(x, lowest) -> Q`` before a quantizer; ``DQ -> Max(., lowest) -> readers`` after one."""
        node = match.node
        lowest = graph.shared_constant("four_bit_guard_lowest", _LOWEST)
        if node.op_type == "QuantizeLinear":
            guarded = graph.unique_name(f"{node.input[0]}_guarded")
            guard = helper.make_node("Max", [node.input[0], lowest], [guarded],
                                     name=graph.unique_node_name(f"{node.name}_guard"))
            graph.insert_before(node, [guard])
            graph.set_input(node, 0, guarded)
            return
        out = node.output[0]
        raw = graph.unique_name(f"{out}_unguarded")
        name = graph.unique_node_name(f"{node.name}_guard")
        graph.set_output(node, 0, raw)
        graph.insert_after(node, [helper.make_node("Max", [raw, lowest], [out], name=name)])
