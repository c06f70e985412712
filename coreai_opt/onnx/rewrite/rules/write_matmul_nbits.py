"""Rule: write weight-only linears as ``MatMulNBits`` with the accuracy level the model asked for.

Sites (:mod:`coreai_opt.onnx.rewrite.matmul_nbits_weight` holds the weight decisions):

* ``MatMul(A, W)`` with ``W`` a constant int4 / uint4 / int8 / uint8 ``DequantizeLinear`` (``[K, N]``, or
  ``[N, K]`` behind ``Transpose(perm=[1, 0])``) and ``A`` not an 8-bit activation ``DequantizeLinear`` (those run
  as ``QLinearMatMul`` / ``QGemm`` / ``DynamicQuantizeMatMul`` and are left alone);
* ``Gemm(A, W, C)`` (``alpha = beta = 1``, ``transA = 0``; ``W`` ``[K, N]``, or ``[N, K]`` with ``transB = 1``)
  with the same ``A`` condition, or whose ``A`` is an int8-compute marker. A weight stored ``[in, out]`` and used
  as ``x @ W + b`` (GPT-2's ``Conv1D``, traced as ``addmm``) exports as such a ``Gemm`` with ``transB = 0``; left to
  onnxruntime, its own ``DequantizeLinear + Gemm`` fusion computes it differently from eager (measured: GPT-2 w4, one
  flipped token with margin 0.0013 against a bound of 0.00024).

``A`` read through the marker ``coreai_opt.Int8ComputeActivation`` (the eager model emulates int8 compute) becomes
``MatMulNBits(x, ..., accuracy_level=4)``; any other ``A`` gives ``accuracy_level=1`` (float compute, eager-equal).
A Gemm bias becomes an ``Add``. A site that cannot be written is a near miss with its reason (e.g. ``"block size 8
is not a power of two >= 16"``); an int8-compute marker left unconsumed makes :func:`finish_matmul_nbits` raise,
naming the node and the reason, since the file would otherwise compute in float what the eager model computes in
int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.matmul_nbits_weight import WeightDQ, matmul_nbits_node, pack_weight
from coreai_opt.onnx.rewrite.prune import prune_unread
from coreai_opt.onnx.rewrite.rewrite_report import RewriteReport
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN, Fail, Match, Rule, import_domains, run_rules
from coreai_opt.quantization.matmul_nbits.int8_compute_op import INT8_COMPUTE_DOMAIN, INT8_COMPUTE_MARKER
from coreai_opt.quantization.matmul_nbits.packing import PackedMatMulNBits

__all__ = ["WriteMatMulNBits", "UnconsumedInt8ComputeError", "finish_matmul_nbits", "write_matmul_nbits"]


class UnconsumedInt8ComputeError(ValueError):
    """A linear asked for int8 compute but its weight cannot be written as ``MatMulNBits``."""


@dataclass(frozen=True)
class _Site(Match):
    a: str
    compute: str
    packed: PackedMatMulNBits
    bias: str | None


def _is_marker(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.domain == INT8_COMPUTE_DOMAIN and node.op_type == INT8_COMPUTE_MARKER


def _weight(name: str, transposed: bool, graph: OnnxGraph) -> WeightDQ | None:
    node = graph.producer(name)
    if node is not None and node.op_type == "Transpose" and list(attributes_of(node).get("perm", [1, 0])) == [1, 0]:
        transposed, node = not transposed, graph.producer(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    zp_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    data, scale = graph.initializer(node.input[0]), graph.initializer(node.input[1])
    zero_point = graph.initializer(zp_name) if zp_name else None
    if data is None or scale is None or (zp_name and zero_point is None):
        return None
    attrs = attributes_of(node)
    return WeightDQ(numpy_helper.to_array(data), data.data_type, numpy_helper.to_array(scale),
                    numpy_helper.to_array(zero_point) if zero_point is not None else None,
                    int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)), transposed)


def _is_8_bit_activation(node: onnx.NodeProto | None, graph: OnnxGraph) -> bool:
    if node is None or node.op_type != "DequantizeLinear":
        return False
    typed = [t for t in (graph.initializer(n) for n in node.input[2:3]) if t is not None]
    typed = typed or [t for t in (graph.initializer(n) for n in node.input[:1]) if t is not None]
    if not typed:  # DynamicQuantizeLinear's uint8 output, or an untyped zero point: uint8
        return True
    return typed[0].data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT8E4M3FN,
                                  onnx.TensorProto.FLOAT8E5M2)


class WriteMatMulNBits(Rule):
    """Weight-only ``MatMul`` / int8-marked ``Gemm`` -> ``MatMulNBits`` (module docstring)."""

    name = "write_matmul_nbits"
    anchors = frozenset({"MatMul", "Gemm"})
    domains = {CONTRIB_DOMAIN: 1}

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A linear whose weight is a constant 4- / 8-bit DequantizeLinear and whose input is no 8-bit activation.

        ``Gemm`` computes ``A · op(W) + C`` with ``op(W) = W`` (``transB = 0``, ``W [K, N]``, the layout of
        ``MatMul``) or ``Wᵀ`` (``transB = 1``, ``W [N, K]``, flagged ``transposed``); the packing writes either as
        ``MatMulNBits``' ``[N, K]`` blocks, and ``C`` becomes an ``Add``.
        """
        if node.domain not in ("", "ai.onnx"):
            return None
        a_node = graph.producer(node.input[0])
        marked = _is_marker(a_node)
        bias = None
        transposed = False
        if not marked and _is_8_bit_activation(a_node, graph):
            return None
        if node.op_type == "Gemm":
            attrs = attributes_of(node)
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                return Fail("Gemm has transA / alpha / beta") if marked else None
            transposed = bool(attrs.get("transB", 0))
            bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        weight = _weight(node.input[1], transposed, graph)
        if weight is None:
            return Fail("weight is not a constant DequantizeLinear") if marked else None
        compute = "int8" if marked else "float"
        packed = pack_weight(weight, compute, int(attributes_of(a_node)["block_size"]) if marked else None)
        if isinstance(packed, str):
            return Fail(packed)
        return _Site(node, a_node.input[0] if marked else node.input[0], compute, packed, bias)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Replace the linear by ``MatMulNBits`` (and an ``Add`` for a Gemm bias)."""
        assert isinstance(match, _Site)
        node, packed = match.node, match.packed
        stem = node.name or node.output[0]
        b = graph.add_initializer(graph.unique_name(f"{stem}_nbits_B"), packed.b)
        scales = graph.add_initializer(graph.unique_name(f"{stem}_nbits_scales"), packed.scales)
        zp = None
        if packed.zero_points is not None:
            zp = graph.add_initializer(graph.unique_name(f"{stem}_nbits_zero_points"), packed.zero_points)
        output = graph.unique_name(f"{stem}_nbits_out") if match.bias else node.output[0]
        nodes = [matmul_nbits_node(packed, match.a, (b, scales, zp), output, f"{stem}_MatMulNBits", match.compute)]
        if match.bias:
            nodes.append(helper.make_node("Add", [output, match.bias], list(node.output), name=f"{stem}_bias"))
        graph.replace(node, nodes)
        prune_unread(graph, node.input)  # the replaced weight's DQ chain and integers, freed now


def finish_matmul_nbits(model: onnx.ModelProto, report: RewriteReport) -> None:
    """Refuse unconsumed int8-compute markers; drop the marker opset (the rule declares the contrib one).

    Raises:
        UnconsumedInt8ComputeError: an int8-compute marker is left (names the linear and the reason).
    """
    graph = OnnxGraph(model)
    markers = [n for n in graph.nodes if _is_marker(n)]
    if markers:
        reasons = {skip.node: skip.reason for skip in report.skipped if skip.rule == WriteMatMulNBits.name}
        lines = []
        for marker in markers:
            for reader in graph.readers(marker.output[0]):
                name = reader.name or reader.output[0]
                lines.append(f"{name} ({reader.op_type}): {reasons.get(name, 'not a linear with a quantized weight')}")
        raise UnconsumedInt8ComputeError(
            "matmul_compute='int8' asks onnxruntime's MatMulNBits to quantize these linears' inputs, but they cannot "
            f"be written as MatMulNBits: {'; '.join(lines)}. Quantize those layers with matmul_compute='float' (e.g. "
            "a module_name override) or with a weight MatMulNBits stores")
    kept = [o for o in model.opset_import if o.domain != INT8_COMPUTE_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def write_matmul_nbits(model: onnx.ModelProto) -> tuple[int, list[tuple[str, str]]]:
    """Apply :class:`WriteMatMulNBits` alone and finish (for tests and callers outside the rule list).

    Returns:
        ``(sites rewritten, near misses as (node name, reason))``.
    """
    graph = OnnxGraph(model)
    rules = [WriteMatMulNBits()]
    report = run_rules(rules, graph)
    graph.write_back()
    import_domains(model, rules, report)
    finish_matmul_nbits(model, report)
    misses = [(s.node, s.reason) for s in report.skipped]
    return report.counts[WriteMatMulNBits.name], misses
