"""Rule: run quantized linears on rank > 2 inputs as ``Gemm``, so onnxruntime builds integer ``QGemm``.

The exporter writes ``nn.Linear`` on a ``[*lead, K]`` input (a transformer's ``[batch, seq, K]``) as
``MatMul(x, W) -> Add(b)``. With QDQ around it onnxruntime can only fuse the MatMul into
``MatMulIntegerToFloat`` (float output): the bias ``Add`` and the output ``QuantizeLinear`` stay separate float
kernels on the whole activation. ``Gemm`` on 2-D operands fuses with the int32 bias and the output quantizer
into one ``QGemm`` that writes int8 directly, as it does for a CNN's classifier. This rule rewrites::

    before:  DQ(x_q), DQ(W_q [K, N]) -> MatMul -> Add(DQ(b_q)) -> Q
    after:   x_q -> Reshape[-1, K] -> DQ, DQ(W_q) -> Gemm(C = DQ(b_q)) -> Q -> Reshape[*lead(x_q), N]

The reshapes move quantized integers (no value changes), and ``Gemm(A, B, C) = A·B + C`` is the same sum as
``MatMul + Add``, so the file computes exactly what it did before; the leading sizes are read at run time when two
or more are symbolic, so a dynamic batch and sequence length keep working: from one ``Shape`` of a graph input
whose shape is exactly those sizes (``input_ids [batch, sequence]``), shared by every linear, else from
``Shape(x_q, end=-1)`` per linear. Measured side by side (corpus 2-layer encoders, dynamic sequence, 1 thread,
batch 1, 400 interleaved rounds; latency / ``quantize_static``'s, median): MPNet 1.29x -> 1.23x (12 ``Shape`` -> 5
in onnxruntime's optimized graph), DeBERTa-v2 1.17x -> 1.11x, BERT 0.98x -> 0.94x.
One flattening ``Reshape`` is shared by every linear reading the same ``x_q`` (e.g. attention's q, k and v).

Only the pattern onnxruntime turns into ``QGemm`` is rewritten: 8-bit per-tensor activation, 8-bit per-tensor or
per-output-channel weight stored as a 2-D constant, a bias ``[N]`` (int32 ``DequantizeLinear`` or float
constant), input rank > 2 (rank-2 linears already export as ``Gemm``). A linear without bias is left as it is
(not a near miss): onnxruntime fuses ``DQ -> MatMul -> Q`` on the 3-D input into ``QLinearMatMul`` itself, and
the reshapes would be two more kernels per linear for nothing (hf-llama, 200 interleaved rounds, latency /
``quantize_static``'s: 1.08x with them, 1.02x without). 4-bit, 16-bit, float8 and blocked weights
keep ``MatMul`` (onnxruntime fuses blocked int4 into ``MatMulNBits`` from that form); they are near misses.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.linear_site import LinearSite, flattened_input, restore_shape
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Rule

__all__ = ["LinearsToGemm"]

_EIGHT_BIT = frozenset({TensorProto.INT8, TensorProto.UINT8})


def _is_8bit(zero_point: np.ndarray | None) -> bool:
    return zero_point is not None and helper.np_dtype_to_tensor_dtype(zero_point.dtype) in _EIGHT_BIT


def _weight_check(view: QdqView, graph: OnnxGraph) -> tuple[int, int] | str:
    """``(K, N)`` of a constant 8-bit ``[K, N]`` weight, per-tensor or per-column, or why it is not one."""
    weight = graph.initializer(view.data)
    if view.block_size:
        return "weight is per-block"
    if view.quant_type not in _EIGHT_BIT:
        return f"weight is {view.type_name} (QGemm takes int8 / uint8 weights)"
    if weight is None or len(weight.dims) != 2:
        return "weight is not a 2-D initializer"
    if view.scale is None or not _is_8bit(view.zero_point):
        return "weight scale or 8-bit zero point is not a constant"
    k, n = (int(d) for d in weight.dims)
    if view.scale.size != 1 and not (view.scale.size == n and view.axis % 2 == 1):
        return "weight scale is neither per-tensor nor per output column"
    return k, n


def _activation_check(view: QdqView) -> str | None:
    """Why the activation's ``DequantizeLinear`` is not 8-bit per-tensor with constant qparams, None if it is."""
    if view.block_size or view.scale is None or view.scale.size != 1:
        return "input is not quantized per-tensor"
    if view.zero_point is None or view.zero_point.size != 1:
        return "input has no constant per-tensor zero point"
    if not _is_8bit(view.zero_point):
        return f"input is {view.type_name} (QGemm takes int8 / uint8 inputs)"
    return None


class LinearsToGemm(Rule):
    """Rewrite quantized rank > 2 ``MatMul (+ Add)`` into ``Reshape -> Gemm -> Reshape`` (module docstring)."""

    name = "linears_to_gemm"
    anchors = frozenset({"MatMul"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> LinearSite | Fail | None:
        """A ``MatMul`` of a dequantized activation and a dequantized constant weight."""
        x_view, w_view = (QdqView.of(graph.producer(name), graph) for name in node.input)
        if x_view is None or w_view is None or not x_view.is_dequantize or not w_view.is_dequantize:
            return None
        if not w_view.data_is_constant:
            return None
        shape = _weight_check(w_view, graph)
        if isinstance(shape, str):
            return Fail(shape)
        if (reason := _activation_check(x_view)) is not None:
            return Fail(reason)
        rank = graph.rank(x_view.data)
        if rank is None:
            return Fail("input rank is unknown (no shape recorded for it)")
        if rank <= 2:
            return None  # rank-2 linears are Gemm already
        site = LinearSite.find(node, x_view, graph, *shape)
        if site.bias is None:
            return None  # onnxruntime fuses DQ -> MatMul [-> Q] as it is: reshapes would only add kernels
        return site

    def rewrite(self, match: LinearSite, graph: OnnxGraph) -> None:
        """Insert ``Reshape -> DQ -> Gemm [-> Q] -> Reshape`` before the MatMul; drop MatMul, Add and Q."""
        site = match
        prefix = f"{site.node.name or site.node.output[0]}_gemm"
        rows = site.rows(graph)
        flat, new = flattened_input(site, graph, prefix, rows)
        flat_dq, gemm_out = graph.unique_name(f"{prefix}_x_2d_dq"), graph.unique_name(f"{prefix}_y_2d")
        new.append(helper.make_node("DequantizeLinear", [flat, *site.x_dequantize.input[1:]], [flat_dq],
                                    name=f"{prefix}_x_dequantize", axis=QdqView.of(site.x_dequantize, graph).axis))
        gemm_inputs = [flat_dq, site.node.input[1], *([site.bias] if site.bias else [])]
        new.append(helper.make_node("Gemm", gemm_inputs, [gemm_out], name=prefix))
        graph.annotate(flat_dq, TensorProto.FLOAT, [rows, site.in_features])
        graph.annotate(gemm_out, TensorProto.FLOAT, [rows, site.out_features])
        final = (site.quantize or site.add or site.node).output[0]
        restored_from = gemm_out
        if site.quantize is not None:
            q = site.quantize
            restored_from = graph.unique_name(f"{prefix}_q_2d")
            new.append(helper.make_node("QuantizeLinear", [gemm_out, *q.input[1:]], [restored_from],
                                        name=f"{prefix}_q", **attributes_of(q)))
            graph.annotate(restored_from, QdqView.of(q, graph).quant_type or TensorProto.UINT8,
                           [rows, site.out_features])
        new += restore_shape(site, graph, restored_from, final, prefix)
        graph.insert_before(site.node, new)
        for node in (site.node, site.add, site.quantize):
            if node is not None:
                graph.remove(node)

    def finish(self, graph: OnnxGraph) -> None:
        """The bias ``DequantizeLinear`` may come after the MatMul it fed: restore a topological order."""
        graph.sort_topologically()

