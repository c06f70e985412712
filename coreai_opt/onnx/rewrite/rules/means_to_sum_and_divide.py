r"""Rule: write a quantized mean that is not a spatial pool as ``ReduceSum`` then ``Div`` by the element count.

OpenVINO 2026.4 CPU computes ``DequantizeLinear(asymmetric uint8) -> ReduceMean -> QuantizeLinear`` wrong (a
transformer's mean pooling over the sequence: 162-165 output steps off, accuracy 99.4 % -> 14 %; docs/openvino.md,
defect 1). The same mean spelled ``ReduceSum -> Div`` compiles to what onnxruntime computes::

    DQ -> ReduceMean(data, axes, keepdims=k)   ==>   DQ -> ReduceSum(data, axes, keepdims=k) -> Div(., float32(n))

with :math:`n = \prod_{a \in axes} d_a` (all dimensions when the mean has no axes). onnxruntime stays bit-exact:
its ``ReduceMean`` is the float32 sum divided by ``n``. Dividing matters: ``ReduceSum -> Mul(1/n)`` rounds ``1/n``
first and differs from the mean by an ulp in a quarter to a third of the values when ``n`` is not a power of two,
which flips the rounding of the next quantizer (tests/onnx/rewrite/test_means_to_sum_and_divide.py measures both,
and against eager ``torch.mean``).

It runs after :mod:`~coreai_opt.onnx.rewrite.rules.means_to_global_average_pool`, so a CNN's spatial mean is already an
integer ``GlobalAveragePool`` and never reaches it. Only means of a dequantized tensor are candidates; one whose
reduced dimensions are not all static (``n`` unknown) or whose axes are not a constant is a near miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["MeansToSumAndDivide"]


@dataclass(frozen=True)
class _Site(Match):
    count: int  # n: elements averaged
    axes: tuple[int, ...] | None  # from an opset < 18 ``axes`` attribute (written as an input), else None


class MeansToSumAndDivide(Rule):
    """Rewrite ``DQ -> ReduceMean`` into ``DQ -> ReduceSum -> Div(n)`` (see the module docstring)."""

    name = "means_to_sum_and_divide"
    anchors = frozenset({"ReduceMean"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``ReduceMean`` of a ``DequantizeLinear`` output over static dimensions."""
        producer = graph.producer(node.input[0])
        if producer is None or producer.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            return None
        attrs = attributes_of(node)
        shape = graph.shape(node.input[0])
        if shape is None:
            return Fail("input shape is not recorded (the element count n is unknown)")
        if "axes" in attrs:
            axes, written = [int(a) for a in attrs["axes"]], tuple(int(a) for a in attrs["axes"])
        elif len(node.input) > 1 and node.input[1]:
            value = graph.constant(node.input[1])
            if value is None:
                return Fail("axes are not a constant")
            axes, written = [int(a) for a in value.reshape(-1)], None
        else:
            axes, written = [], None
        if not axes:
            if int(attrs.get("noop_with_empty_axes", 0)):
                return None  # an identity, not a mean
            axes = list(range(len(shape)))
        dims = [shape[a % len(shape)] for a in axes]
        if not all(isinstance(d, int) for d in dims):
            return Fail(f"reduced dimensions {dims} are not all static (n is unknown)")
        return _Site(node, math.prod(dims), written)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """``ReduceSum`` with the mean's inputs and attributes, then ``Div`` by ``float32(n)``."""
        node = match.node
        attrs = {k: v for k, v in attributes_of(node).items() if k != "axes"}
        inputs = list(node.input)
        if match.axes is not None:  # opset < 18 ReduceMean had axes as an attribute; ReduceSum (13+) takes an input
            axes = graph.add_initializer(graph.unique_name(f"{node.name or node.output[0]}_axes"),
                                         np.array(match.axes, np.int64))
            inputs = [inputs[0], axes]
        summed = graph.unique_name(f"{node.output[0]}_sum")
        count = graph.add_initializer(graph.unique_name(f"{node.name or node.output[0]}_count"),
                                      np.array(match.count, np.float32))
        name = graph.unique_node_name
        graph.replace(node, [
            helper.make_node("ReduceSum", inputs, [summed], name=name(f"{node.name}_sum"), **attrs),
            helper.make_node("Div", [summed, count], list(node.output), name=name(f"{node.name}_div")),
        ])
