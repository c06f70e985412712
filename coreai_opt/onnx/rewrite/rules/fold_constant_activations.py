"""Rule: store an activation quantizer whose input is computed from constants only as its quantized integers.

A learned position embedding read at constant positions (``arange(T)``: our exports keep the sequence length static)
is, after :mod:`~coreai_opt.onnx.rewrite.rules.gather_quantized_rows`, a branch with no run-time input::

    Gather(W_q, const_idx) -> Cast -> Mul(Unsqueeze(Gather(row_scale, const_idx))) -> QuantizeLinear(s, zp) -> DQ

OpenVINO 2026.4 CPU constant-folds that branch down to a dequantized constant and then fails to compile the
embedding ``Add`` it feeds (``[AddTransformation] ... Check 'index < m_inputs.size()' failed``; docs/openvino.md,
defect 2). This rule evaluates the ``QuantizeLinear`` once with onnxruntime's arithmetic
(:class:`~coreai_opt.onnx.rewrite.constant_folder.ConstantFolder`: ``saturate(round_half_even(x / s) + zp)``,
float32 division) and stores the result as an integer initializer::

    ... -> QuantizeLinear(s, zp) -> DequantizeLinear(., s, zp)   ==>   DequantizeLinear(C, s, zp)

so onnxruntime reads exactly the integers it computed before (bit-identical outputs) and does less work per run.
Quantizers of weights were already folded by :mod:`~coreai_opt.onnx.rewrite.rules.fold_quantized_weights`; a
quantizer whose constant input the folder refuses (e.g. a float16 input) is a near miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.constant_folder import ConstantFolder
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["FoldConstantActivations"]


@dataclass(frozen=True)
class _Site(Match):
    value: np.ndarray  # the integers the QuantizeLinear computes


class FoldConstantActivations(Rule):
    """Replace a ``QuantizeLinear`` of a constant-only branch by the initializer it computes (module docstring)."""

    name = "fold_constant_activations"
    anchors = frozenset({"QuantizeLinear"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``QuantizeLinear`` of a computed (not stored) value that the folder evaluates from constants."""
        if node.domain not in ("", "ai.onnx") or graph.producer(node.input[0]) is None:
            return None  # a graph input, or a stored weight (folded by fold_quantized_weights)
        folder = ConstantFolder(graph)
        value = folder.value(node.output[0])
        if value is None:
            return Fail(f"constant input not folded: {folder.refusal}") if folder.refusal else None
        if node.output[0] in graph.outputs:
            return Fail("its output is a graph output (it cannot become an initializer)")
        return _Site(node, value)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Add the integers as an initializer and make every reader of the quantizer's output read it."""
        node = match.node
        folded = graph.add_initializer(graph.unique_name(f"{node.output[0]}_folded"), match.value)
        graph.replace_uses(node.output[0], folded)
        graph.remove(node)
