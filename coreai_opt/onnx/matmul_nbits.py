"""ONNX post-pass: write weight-only linears as ``MatMulNBits`` with the accuracy level the model asked for.

Sites (match / rewrite split, the contract of the rule framework; :mod:`coreai_opt.onnx.matmul_nbits_weight` holds
the weight decisions):

* ``MatMul(A, W)`` with ``W`` a constant int4 / uint4 / int8 / uint8 ``DequantizeLinear`` (``[K, N]``, or
  ``[N, K]`` behind ``Transpose(perm=[1, 0])``) and ``A`` not an 8-bit activation ``DequantizeLinear`` (those run
  as ``QLinearMatMul`` / ``QGemm`` / ``DynamicQuantizeMatMul`` and are left alone);
* ``Gemm(A, W, C)`` (``alpha = beta = 1``, ``transA = 0``) whose ``A`` is an int8-compute marker; a float-compute
  ``Gemm`` stays a float ``Gemm`` (onnxruntime does not fuse it).

``A`` read through the marker ``coreai_opt.Int8ComputeActivation`` (the eager model emulates int8 compute) becomes
``MatMulNBits(x, ..., accuracy_level=4)``; any other ``A`` gives ``accuracy_level=1`` (float compute, eager-equal).
A Gemm bias becomes an ``Add``. A site that cannot be written returns its reason (e.g. ``"block size 8 is not a
power of two >= 16"``); an int8-compute marker left unconsumed makes :func:`write_matmul_nbits` raise, naming the
node and the reason, since the file would otherwise compute in float what the eager model computes in int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, producers_of, readers_of, remove_dead, unique_name
from coreai_opt.onnx.matmul_nbits_weight import MATMUL_NBITS_DOMAIN, WeightDQ, matmul_nbits_node, pack_weight
from coreai_opt.quantization.spec.int8_compute_op import INT8_COMPUTE_DOMAIN, INT8_COMPUTE_MARKER
from coreai_opt.quantization.spec.matmul_nbits_packing import PackedMatMulNBits

__all__ = ["MatMulNBitsSite", "match_matmul_nbits", "write_matmul_nbits", "UnconsumedInt8ComputeError"]


class UnconsumedInt8ComputeError(ValueError):
    """A linear asked for int8 compute but its weight cannot be written as ``MatMulNBits``."""


@dataclass(frozen=True)
class MatMulNBitsSite:
    """One matched site.

    Attributes:
        node: The ``MatMul`` / ``Gemm``.
        a: The activation ``MatMulNBits`` reads (the marker's input for int8 compute).
        compute: ``"float"`` or ``"int8"``.
        packed: The packed weight.
        bias: The ``Gemm`` bias (``C``), else None.
    """

    node: onnx.NodeProto
    a: str
    compute: str
    packed: PackedMatMulNBits
    bias: str | None


def _is_marker(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.domain == INT8_COMPUTE_DOMAIN and node.op_type == INT8_COMPUTE_MARKER


def _weight(name: str, transposed: bool, producers: dict, inits: dict) -> WeightDQ | None:
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose" and list(attributes_of(node).get("perm", [1, 0])) == [1, 0]:
        transposed, node = not transposed, producers.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    zp_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if node.input[0] not in inits or node.input[1] not in inits or (zp_name and zp_name not in inits):
        return None
    attrs = attributes_of(node)
    data = inits[node.input[0]]
    return WeightDQ(numpy_helper.to_array(data), data.data_type, numpy_helper.to_array(inits[node.input[1]]),
                    numpy_helper.to_array(inits[zp_name]) if zp_name else None, int(attrs.get("axis", 1)),
                    int(attrs.get("block_size", 0)), transposed)


def _is_8_bit_activation(node: onnx.NodeProto | None, inits: dict) -> bool:
    if node is None or node.op_type != "DequantizeLinear":
        return False
    typed = [inits[n] for n in node.input[2:3] if n in inits] or [inits[n] for n in node.input[:1] if n in inits]
    if not typed:  # DynamicQuantizeLinear's uint8 output, or an untyped zero point: uint8
        return True
    return typed[0].data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT8E4M3FN,
                                  onnx.TensorProto.FLOAT8E5M2)


def match_matmul_nbits(node: onnx.NodeProto, producers: dict, inits: dict) -> MatMulNBitsSite | str | None:
    """The site at ``node``, the near-miss reason, or None when ``node`` is no candidate."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    a_node = producers.get(node.input[0])
    marked = _is_marker(a_node)
    bias = None
    transposed = False
    if node.op_type == "Gemm":
        attrs = attributes_of(node)
        if not marked:
            return None
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return "Gemm has transA / alpha / beta"
        transposed = bool(attrs.get("transB", 0))
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    elif _is_8_bit_activation(a_node, inits):
        return None
    weight = _weight(node.input[1], transposed, producers, inits)
    if weight is None:
        return "weight is not a constant DequantizeLinear" if marked else None
    compute = "int8" if marked else "float"
    packed = pack_weight(weight, compute, int(attributes_of(a_node)["block_size"]) if marked else None)
    if isinstance(packed, str):
        return packed
    return MatMulNBitsSite(node, a_node.input[0] if marked else node.input[0], compute, packed, bias)


def _rewrite(site: MatMulNBitsSite, graph: onnx.GraphProto, taken: set[str]) -> list[onnx.NodeProto]:
    stem = site.node.name or site.node.output[0]
    packed = site.packed
    names = [unique_name(f"{stem}_nbits_{part}", taken) for part in ("B", "scales")]
    graph.initializer.extend([numpy_helper.from_array(packed.b, names[0]),
                              numpy_helper.from_array(packed.scales, names[1])])
    zp = None
    if packed.zero_points is not None:
        zp = unique_name(f"{stem}_nbits_zero_points", taken)
        graph.initializer.append(numpy_helper.from_array(packed.zero_points, zp))
    output = unique_name(f"{stem}_nbits_out", taken) if site.bias else site.node.output[0]
    nodes = [matmul_nbits_node(packed, site.a, (names[0], names[1], zp), output, f"{stem}_MatMulNBits",
                               site.compute)]
    if site.bias:
        nodes.append(helper.make_node("Add", [output, site.bias], list(site.node.output), name=f"{stem}_bias"))
    return nodes


def _set_opsets(model: onnx.ModelProto, wrote: bool) -> None:
    kept = [o for o in model.opset_import if o.domain != INT8_COMPUTE_DOMAIN]
    if wrote and not any(o.domain == MATMUL_NBITS_DOMAIN for o in kept):
        kept.append(helper.make_opsetid(MATMUL_NBITS_DOMAIN, 1))
    del model.opset_import[:]
    model.opset_import.extend(kept)


def write_matmul_nbits(model: onnx.ModelProto) -> tuple[int, list[tuple[str, str]]]:
    """Rewrite every site in place (module docstring).

    Returns:
        ``(sites rewritten, near misses as (node name, reason))``.

    Raises:
        UnconsumedInt8ComputeError: an int8-compute marker is left (names the linear and the reason).
    """
    graph = model.graph
    producers = producers_of(graph)
    inits = {t.name: t for t in graph.initializer}
    taken = {o for n in graph.node for o in n.output} | set(inits) | {i.name for i in graph.input}
    new_nodes: list[onnx.NodeProto] = []
    misses: list[tuple[str, str]] = []
    count = 0
    for node in graph.node:
        site = match_matmul_nbits(node, producers, inits)
        if isinstance(site, MatMulNBitsSite):
            new_nodes += _rewrite(site, graph, taken)
            count += 1
            continue
        if isinstance(site, str):
            misses.append((node.name or node.output[0], site))
        new_nodes.append(node)
    if count:
        del graph.node[:]
        graph.node.extend(new_nodes)
        remove_dead(graph)
    _refuse_unconsumed_markers(graph, misses)
    _set_opsets(model, count > 0)
    return count, misses


def _refuse_unconsumed_markers(graph: onnx.GraphProto, misses: list[tuple[str, str]]) -> None:
    markers = [n for n in graph.node if _is_marker(n)]
    if not markers:
        return
    readers = readers_of(graph)
    reasons = dict(misses)
    lines = []
    for marker in markers:
        for reader in readers.get(marker.output[0], []):
            name = reader.name or reader.output[0]
            lines.append(f"{name} ({reader.op_type}): {reasons.get(name, 'not a linear with a quantized weight')}")
    raise UnconsumedInt8ComputeError(
        "matmul_compute='int8' asks onnxruntime's MatMulNBits to quantize these linears' inputs, but they cannot be "
        f"written as MatMulNBits: {'; '.join(lines)}. Quantize those layers with matmul_compute='float' (e.g. a "
        "module_name override) or with a weight MatMulNBits stores")
