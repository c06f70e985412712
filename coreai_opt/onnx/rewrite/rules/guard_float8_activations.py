"""Rule: keep ``Relu``/``Clip`` in front of a float8/4-bit ``QuantizeLinear`` from being deleted.

onnxruntime's graph optimizer (``ORT_ENABLE_EXTENDED`` and above) removes a ``Relu`` or ``Clip`` that directly
feeds a ``QuantizeLinear`` whose zero point is 0, on the reasoning that the quantized range already starts at 0.
That holds for uint8 with zero point 0, but not for float8: float8 represents negative values, so after the
rewrite negative activations pass through and the model's outputs change (measured: a digits CNN drops from
99.6 % to 34.9 % accuracy under the fp8 preset, while the unoptimized session matches eager bit for bit). The
same rewrite misfires in front of int4/uint4 quantizers (measured: off by 3-27 output steps without the guard,
exact with it); uint8/int8/16-bit are handled correctly.

This rule rewrites exactly those nodes into the same function spelled with ops the optimizer leaves alone:

* ``Relu(x)`` -> ``Max(x, 0)``
* ``Clip(x, lo, hi)`` -> ``Min(Max(x, lo), hi)`` (only the bounds that are given)

``Max(x, 0)`` equals ``Relu(x)`` for every float, so the exported values do not change.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import FLOAT8_TYPES, QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["GuardFloat8Activations"]

_GUARDED_TYPES = FLOAT8_TYPES | {TensorProto.INT4, TensorProto.UINT4}


class GuardFloat8Activations(Rule):
    """Rewrite ``Relu``/``Clip`` feeding a float8 or 4-bit ``QuantizeLinear`` with ``Max``/``Min`` (docstring)."""

    name = "guard_float8_activations"
    anchors = frozenset({"Relu", "Clip"})
    #: As before the rule framework (the export stays byte-identical): what it leaves unused stays in the file.

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | Fail | None:
        """A ``Relu``/``Clip`` whose output is quantized to float8 / int4 / uint4."""
        views = [QdqView.of(r, graph) for r in graph.readers(node.output[0])]
        quantizers = [v for v in views if v is not None and not v.is_dequantize and v.data == node.output[0]]
        if any(v.quant_type in _GUARDED_TYPES for v in quantizers):
            return Match(node)
        if any(v.quant_type is None for v in quantizers):
            return Fail("the QuantizeLinear reading it has a zero point that is not a constant (type unknown)")
        return None

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Spell the activation with ``Max`` / ``Min``."""
        node = match.node
        x, out = node.input[0], node.output[0]
        if node.op_type == "Relu":
            zero = graph.add_initializer(graph.unique_name(f"{node.name or out}_zero"), np.array(0.0, np.float32))
            graph.replace(node, [helper.make_node("Max", [x, zero], [out],
                                                  name=graph.unique_node_name(f"{node.name}_max"))])
            return
        lo = node.input[1] if len(node.input) > 1 and node.input[1] else None
        hi = node.input[2] if len(node.input) > 2 and node.input[2] else None
        nodes, current, name = [], x, graph.unique_node_name
        if lo is not None:
            lowered = out if hi is None else graph.unique_name(f"{out}_lower")
            nodes.append(helper.make_node("Max", [current, lo], [lowered], name=name(f"{node.name}_max")))
            current = lowered
        if hi is not None:
            nodes.append(helper.make_node("Min", [current, hi], [out], name=name(f"{node.name}_min")))
        if lo is None and hi is None:
            nodes.append(helper.make_node("Identity", [x], [out], name=name(f"{node.name}_identity")))
        graph.replace(node, nodes)
