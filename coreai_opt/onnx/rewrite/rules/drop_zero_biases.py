"""Rule: remove conv / gemm biases that are exactly zero.

Folding a BatchNorm whose shift is zero (``β = μ·γ/σ``, e.g. a freshly initialised BN) gives a convolution an
all-zero bias, which the export stores as an int32 ``DequantizeLinear`` input. onnxruntime then adds it to every
output element of its integer kernel; adding zero changes no value, so the input is dropped (``Conv``,
``ConvTranspose`` and ``Gemm`` take the bias as an optional last input). Only constant biases whose every element
is 0 are removed (a float constant, or a ``DequantizeLinear`` of one with a zero point of 0 or none).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["DropZeroBiases"]

#: Op type -> index of its optional bias input.
_BIAS_INPUT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}


@dataclass(frozen=True)
class _Site(Match):
    index: int


def _bias_value(name: str, graph: OnnxGraph) -> np.ndarray | None:
    """The bias as stored: a constant, or the stored data of a ``DequantizeLinear`` whose zero point is 0."""
    value = graph.constant(name)
    if value is not None:
        return value
    view = QdqView.of(graph.producer(name), graph)
    if view is None or not view.is_dequantize or not view.zero_point_is_zero:
        return None
    return graph.constant(view.data)


class DropZeroBiases(Rule):
    """Remove all-zero constant bias inputs of ``Conv`` / ``ConvTranspose`` / ``Gemm`` (module docstring)."""

    name = "drop_zero_biases"
    anchors = frozenset(_BIAS_INPUT)

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A conv / gemm whose bias input is given."""
        index = _BIAS_INPUT[node.op_type]
        if len(node.input) <= index or not node.input[index]:
            return None
        value = _bias_value(node.input[index], graph)
        if value is None:
            return Fail("bias is not a constant (nor a DequantizeLinear of one with a zero zero point)")
        return None if np.any(value) else _Site(node, index)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Delete the bias input (what only it read is removed afterwards)."""
        graph.remove_input(match.node, match.index)
