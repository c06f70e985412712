"""Rule: read the rows of a per-block quantized embedding table with ``GatherBlockQuantized``, never the whole table.

An ``nn.Embedding`` with a per-block weight (int4 / uint4 / int8 / uint8, blocks along the embedding dim) exports as
``DequantizeLinear(W_q, axis=1, block_size) -> Gather(indices)``. onnxruntime never constant-folds a
``DequantizeLinear``, so every run dequantizes the whole ``[vocab, dim]`` table to read ``batch × seq`` rows of it
(all-MiniLM-L6-v2, 30522 × 384 int4: batch-1 latency 2.28× fp32). This rule writes each such ``Gather`` as
onnxruntime's contrib op ``com.microsoft.GatherBlockQuantized(data, indices, scales, zero_points, gather_axis=0,
quantize_axis=1, bits, block_size)``, which gathers the quantized rows and dequantizes only them::

    int4 / uint4 table:  GatherBlockQuantized(W_q, idx, scale, zero_point)         (the tensors as they are)
    uint8 table:         GatherBlockQuantized(W_q, idx, scale, zero_point or 0)    (bits=8)
    int8 table:          GatherBlockQuantized(W_q + 128, idx, scale, zero_point + 128)  (uint8, bits=8)

Its kernel computes ``float(q − z) · s`` per element, as ``DequantizeLinear`` does (``q − z`` is an exact small
integer), so the rows are bit-identical (tests compare the bits in onnxruntime, with and without graph optimisation,
and in OpenVINO). An int8 table is stored shifted by 128 (the kernel reads 8-bit data as uint8): ``(q + 128) −
(z + 128) = q − z``, and the file is no larger. One behaviour differs on bad input only: an index outside
``[-vocab, vocab)`` gives a row of zeros where ``Gather`` fails.

Why the contrib op and not standard ops (``Gather`` the quantized rows, ``Gather`` their scales and zero points, then
a blocked ``DequantizeLinear``), measured with onnxruntime 1.32 and OpenVINO 2026.4:

* onnxruntime rejects ``Gather`` on int4 / uint4 (``INVALID_GRAPH: Type 'tensor(int4)' of input parameter of
  operator (Gather) is invalid``), so 4-bit tables have no standard-op form short of storing them at 8 bits
  (twice the bytes) or unpacking nibbles by hand;
* OpenVINO refuses a blocked ``DequantizeLinear`` whose input has a dynamic shape (``DequantizeLinear cannot operate
  with dynamic shapes of input X``), so even the 8-bit standard-op form would not run there, while OpenVINO's ONNX
  frontend runs ``GatherBlockQuantized`` (int4, uint4, uint8) bit-exactly.

Tied tables. A table also read by other nodes (a tied LM head's ``DequantizeLinear -> MatMul``) keeps its
``DequantizeLinear`` for them; the rows are gathered from the same quantized initializer, so the file holds it
once (an int8 table, which would need a shifted copy, is then a near miss). When ``write_matmul_nbits`` already
stored the table for a ``MatMulNBits`` (whose ``B``, ``scales`` and ``zero_points`` are the unsigned per-block
packing ``GatherBlockQuantized`` reads for uint8 data, two 4-bit values a byte, low nibble first), the rows are
gathered from those initializers (``Reshape``-d to 2-D, which onnxruntime folds at load) and the table's own copy
goes: one quantized table in the file, found by comparing the packed bytes, so it is shared only when every value
is the same.

Near misses name the reason: a block size GatherBlockQuantized does not take (a power of two >= 16), blocks along
the rows, a scale that is not float32, a table type it does not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN, Fail, Match, Rule
from coreai_opt.quantization.matmul_nbits.packing import pack_matmul_nbits

__all__ = ["GatherBlockQuantizedRows"]

#: Table types the rule reads -> (bits, signed).
_TABLE_TYPES = {TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False), TensorProto.INT8: (8, True),
                TensorProto.UINT8: (8, False)}


@dataclass(frozen=True)
class _Source:
    """Where ``GatherBlockQuantized`` reads from: initializer names (shared) or arrays to add (``data``...)."""

    data: str | np.ndarray
    scales: str
    zero_points: str | np.ndarray | None
    bits: int
    reshape_to: tuple[tuple[int, int], ...] = ()  # 2-D shapes of (data, scales[, zero_points]) when shared


@dataclass(frozen=True)
class _Site(Match):
    view: QdqView
    gathers: tuple[onnx.NodeProto, ...]
    source: _Source
    all_readers: bool  # every reader of the dequantized table is rewritten: the DequantizeLinear goes


class GatherBlockQuantizedRows(Rule):
    """``DequantizeLinear(per-block table) -> Gather(axis=0)`` -> ``GatherBlockQuantized`` (module docstring)."""

    name = "gather_block_quantized_rows"
    anchors = frozenset({"DequantizeLinear"})
    domains = {CONTRIB_DOMAIN: 1}

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A constant per-block table's ``DequantizeLinear`` read by at least one ``Gather``."""
        view = QdqView.of(node, graph)
        if view is None or not view.block_size or graph.initializer(view.data) is None:
            return None
        readers = graph.readers(node.output[0])
        if not any(r.op_type == "Gather" and r.input[0] == node.output[0] for r in readers):
            return None
        problem = _table_problem(view, graph)
        if problem:
            return Fail(problem)
        gathers = tuple(r for r in readers if r.op_type == "Gather" and r.input[0] == node.output[0]
                        and int(attributes_of(r).get("axis", 0)) == 0)
        if not gathers:
            return Fail("the Gather reads along an axis other than 0 (rows)")
        all_readers = len(gathers) == len(readers) and node.output[0] not in graph.outputs
        source = (all_readers and _shared_matmul_nbits(view, graph)) or _own_source(view, graph, all_readers)
        if isinstance(source, str):
            return Fail(source)
        return _Site(node, view, gathers, source, all_readers)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Replace each ``Gather`` by ``GatherBlockQuantized``; drop the ``DequantizeLinear`` if nothing else reads."""
        assert isinstance(match, _Site)
        stem = match.gathers[0].name or match.gathers[0].output[0]
        inputs, reshapes = _source_inputs(match.source, stem, graph)
        graph.insert_before(match.gathers[0], reshapes)
        for gather in match.gathers:
            data, scales, zero_points = inputs
            node = helper.make_node(
                "GatherBlockQuantized", [data, gather.input[1], scales] + ([zero_points] if zero_points else []),
                list(gather.output), name=f"{gather.name or gather.output[0]}_block_quantized", domain=CONTRIB_DOMAIN,
                bits=match.source.bits, block_size=match.view.block_size, gather_axis=0, quantize_axis=1)
            graph.replace(gather, [node])
        if match.all_readers:
            graph.remove(match.node)


def _table_problem(view: QdqView, graph: OnnxGraph) -> str | None:
    """Why ``GatherBlockQuantized`` cannot read this table (None: it can)."""
    table = graph.initializer(view.data)
    if not view.has_constant_qparams:
        return "table scale or zero point is not a constant"
    if table.data_type not in _TABLE_TYPES or len(table.dims) != 2:
        return (f"table is {view.type_name} of rank {len(table.dims)} (GatherBlockQuantized reads 2-D int4 / uint4 / "
                "int8 / uint8 tables)")
    if view.axis % 2 != 1:
        return "table blocks run along the rows (axis 0); GatherBlockQuantized needs them along the embedding dim"
    block = view.block_size
    if block < 16 or block & (block - 1):
        return f"block size {block} is not a power of two >= 16 (GatherBlockQuantized)"
    if view.scale.dtype != np.float32:
        return f"table scale is {view.scale.dtype}, GatherBlockQuantized is written for float32 rows here"
    return None


def _own_source(view: QdqView, graph: OnnxGraph, all_readers: bool) -> _Source | str:
    """The table's own initializers (an int8 table shifted to uint8), or why that would store it twice."""
    bits, signed = _TABLE_TYPES[graph.initializer(view.data).data_type]
    zero_point = view.zero_point_name if view.zero_point_name and not view.zero_point_is_zero else None
    if bits == 4:  # GatherBlockQuantized reads int4 / uint4 as they are, zero point default 0 like DequantizeLinear
        return _Source(view.data, view.scale_name, zero_point, 4)
    if not signed:  # uint8: the kernel's zero-point default is 128, DequantizeLinear's is 0
        stored = view.zero_point_name or np.zeros(view.scale.shape, np.uint8)
        return _Source(view.data, view.scale_name, stored, 8)
    if not all_readers:
        return ("int8 table is also read by other nodes; GatherBlockQuantized reads 8-bit data as uint8, a shifted "
                "copy would store the table twice")
    shifted = (graph.constant(view.data).astype(np.int16) + 128).astype(np.uint8)
    z = None if zero_point is None else (view.zero_point.astype(np.int16) + 128).astype(np.uint8)
    return _Source(shifted, view.scale_name, z, 8)  # no zero point: the kernel's default 128 is int8's 0


def _shared_matmul_nbits(view: QdqView, graph: OnnxGraph) -> _Source | None:
    """The initializers of a ``MatMulNBits`` that stores exactly this table, if there is one."""
    vocab, dim = graph.initializer(view.data).dims
    block = view.block_size
    bits, signed = _TABLE_TYPES[graph.initializer(view.data).data_type]
    if dim % block:
        return None  # MatMulNBits pads the last block; its rows would be longer than the table's
    candidates = [n for n in graph.nodes if n.op_type == "MatMulNBits" and n.domain == CONTRIB_DOMAIN
                  and _attrs_match(attributes_of(n), vocab, dim, bits, block)]
    if not candidates:
        return None
    zero_point = None if view.zero_point is None else view.zero_point.astype(np.int64)
    packed = pack_matmul_nbits(graph.constant(view.data), view.scale, zero_point, bits, signed, block)
    for node in candidates:
        names = [*node.input[1:4], ""][:3]
        values = [graph.constant(name) if name else None for name in names]
        if any(name and value is None for name, value in zip(names, values, strict=True)):
            continue
        expected = (packed.b, packed.scales, packed.zero_points)
        if all(_same(a, b) for a, b in zip(values, expected, strict=True)):
            blocks = dim // block
            shapes = ((vocab, dim * bits // 8), (vocab, blocks))
            if packed.zero_points is not None:
                shapes += ((vocab, packed.zero_points.size // vocab),)
            return _Source(names[0], names[1], names[2] or None, bits, shapes)
    return None


def _attrs_match(attrs: dict[str, object], vocab: int, dim: int, bits: int, block: int) -> bool:
    return (int(attrs.get("N", -1)), int(attrs.get("K", -1)), int(attrs.get("bits", 4)),
            int(attrs.get("block_size", -1))) == (vocab, dim, bits, block)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.size == b.size and np.array_equal(a.reshape(-1), b.reshape(-1))


def _source_inputs(source: _Source, stem: str, graph: OnnxGraph) -> tuple[tuple[str, str, str | None],
                                                                          list[onnx.NodeProto]]:
    """Input names of ``GatherBlockQuantized`` (adding the arrays and ``Reshape`` nodes a source needs)."""
    names = []
    for role, value in (("data", source.data), ("scales", source.scales), ("zero_points", source.zero_points)):
        if isinstance(value, np.ndarray):
            value = graph.add_initializer(graph.unique_name(f"{stem}_block_quantized_{role}"), value)
        names.append(value)
    reshapes = []
    for index, shape in enumerate(source.reshape_to):
        target = graph.shared_constant(f"{stem}_block_quantized_shape", np.array(shape, np.int64))
        output = graph.unique_name(f"{names[index]}_rows")
        reshapes.append(helper.make_node("Reshape", [names[index], target], [output],
                                         name=graph.unique_node_name(f"{stem}_reshape_{index}")))
        names[index] = output
    data, scales, zero_points = names
    return (data, scales, zero_points), reshapes
