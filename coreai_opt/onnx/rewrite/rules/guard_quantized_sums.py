r"""Rule: put ``Max(x, lowest float32)`` between an asymmetric integer ``DequantizeLinear`` and its ``ReduceSum``.

OpenVINO 2026.4 CPU's low-precision transformations fold the dequantization of such a ``ReduceSum``'s input into
the sum and get the zero point wrong in some graphs (:mod:`~coreai_opt.onnx.rewrite.rules.means_to_sum_and_divide`
writes every quantized mean as ``ReduceSum -> Div``). Minimal graph ``reshaped_sum`` (tests/onnx/openvino_graphs.py,
the shape of the zoo's shape_unpack): ``DQ(uint8, zp 116) -> Reshape -> Q -> DQ -> ReduceSum -> Div(8) -> Q -> DQ``
is 155 output steps off; exact with zero point 0, exact without the second Q/DQ. On the zoo w4a8 files
(docs/openvino.md, defect 5): shape_unpack 85 logit steps (6 allowed, top-1 0 %), transformer_encoder 124 (28
allowed, top-1 46.9 %). In transformer_encoder the sum reads a LayerNorm's quantizer and the trigger lies further
up: every tensor before the sum is exact (each measured as the only output of the file cut there), the five nodes
from the LayerNorm output on are exact fed the same values, the tail from the last attention block on fails, the
tail from its feed-forward block on does not; with every weight in float32 it still fails (the int4 weights are
not the cause). The w8a8 files of both models are exact without the guard.

The guard is an op those transformations do not move a dequantization through, so OpenVINO sums float values::

    DQ(x_q, s, zp != 0) -> ReduceSum   ==>   DQ(x_q, s, zp) -> Max(., -3.4028235e38) -> ReduceSum

No value changes: a ``DequantizeLinear`` output is finite and :math:`\max(x, -3.4\cdot10^{38}) = x` for every
finite float32, so onnxruntime's result is bit-identical (no onnxruntime fusion reads a ``ReduceSum``). Only 8-bit
and 4-bit integer quantizers with a constant non-zero zero point are guarded (a zero point of 0 has no
subtraction to misplace: the symmetric w8a8_sym file was exact without it; 16-bit pairs are stripped by OpenVINO
anyway, see :mod:`~coreai_opt.onnx.rewrite.rules.clip_16bit_activations`). The guard is the same ``Max`` as
:mod:`~coreai_opt.onnx.rewrite.rules.guard_4bit_activations`', which therefore does not guard that output again.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Match, Rule

__all__ = ["GuardQuantizedSums"]

_LOWEST = np.array(np.finfo(np.float32).min, dtype=np.float32)


class GuardQuantizedSums(Rule):
    """Guard the input of a ``ReduceSum`` that reads an asymmetric integer ``DequantizeLinear`` (module docstring)."""

    name = "guard_quantized_sums"
    anchors = frozenset({"ReduceSum"})
    #: Only the guard is added: what other rules left unused stays in the file (other exports stay byte-identical).

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | None:
        """A default-domain ``ReduceSum`` whose data is an 8- or 4-bit integer ``DequantizeLinear`` with zp != 0."""
        if node.domain not in ("", "ai.onnx"):
            return None
        view = QdqView.of(graph.producer(node.input[0]), graph)
        if view is None or not view.is_dequantize or view.data_is_constant:
            return None
        info = view.type_info
        if info is None or info.is_float or info.bits > 8 or view.zero_point is None or view.zero_point_is_zero:
            return None
        return Match(node)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """``DQ -> Max(., lowest) -> ReduceSum``."""
        node = match.node
        lowest = graph.shared_constant("quantized_sum_guard_lowest", _LOWEST)
        guarded = graph.unique_name(f"{node.input[0]}_guarded")
        guard = helper.make_node("Max", [node.input[0], lowest], [guarded],
                                 name=graph.unique_node_name(f"{node.name}_guard"))
        graph.insert_before(node, [guard])
        graph.set_input(node, 0, guarded)
