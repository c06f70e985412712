"""Rule: read the shape of a quantized activation from its ``QuantizeLinear``, so the float value keeps one reader.

onnxruntime fuses ``DQ → Conv → Q`` (likewise ``MatMul``, ``Add``, ``Mul`` ...) into one integer kernel only when
the op's float output is read by the ``QuantizeLinear`` alone. torch's exporter reads the sizes of a value where
the model asked for them (``x.shape`` under a dynamic batch): in timm's EfficientNetV2-B0 two ``Shape`` readers of
four convolutions' outputs left those four of its 92 convolutions in float (``Conv`` between ``DequantizeLinear``
and ``QuantizeLinear``). ``QuantizeLinear`` keeps the shape of its input, so such a reader reads the quantized
value's shape instead: the same numbers, and the float output's only reader is its ``QuantizeLinear``.

Only ``Shape`` / ``Size`` readers of a value whose other readers are all its ``QuantizeLinear`` are rewired (with
another float reader the fusion is out of reach anyway). The rule runs last, when no later rule removes a
``QuantizeLinear`` (a folded weight's or constant branch's) that a rewired reader would then miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.rule import Match, Rule

__all__ = ["ShapesFromQuantized"]

_SHAPE_READERS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class _Site(Match):
    quantized: str


class ShapesFromQuantized(Rule):
    """Rewire ``Shape`` / ``Size`` of a quantized activation to its ``QuantizeLinear``'s output (module docstring)."""

    name = "shapes_from_quantized"
    anchors = _SHAPE_READERS

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | None:
        """A shape reader of a value read otherwise only by one ``QuantizeLinear``."""
        value = node.input[0]
        readers = graph.readers(value)
        quantizers = [r for r in readers if r.op_type == "QuantizeLinear" and r.input[0] == value]
        if len(quantizers) != 1 or value in graph.outputs or graph.producer(value) is None:
            return None
        if any(r.op_type not in _SHAPE_READERS and r is not quantizers[0] for r in readers):
            return None
        return _Site(node, quantizers[0].output[0])

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Read the quantized value's shape."""
        graph.set_input(match.node, 0, match.quantized)

    def finish(self, graph: OnnxGraph) -> None:
        """A shape reader may come before the ``QuantizeLinear`` it now reads: restore a topological order."""
        graph.sort_topologically()
