"""ONNX post-pass: run quantized linears on rank > 2 inputs as ``Gemm``, so onnxruntime builds integer ``QGemm``.

The exporter writes ``nn.Linear`` on a ``[*lead, K]`` input (a transformer's ``[batch, seq, K]``) as
``MatMul(x, W) -> Add(b)``. With QDQ around it onnxruntime can only fuse the MatMul into
``MatMulIntegerToFloat`` (float output): the bias ``Add`` and the output ``QuantizeLinear`` stay separate float
kernels on the whole activation. ``Gemm`` on 2-D operands fuses with the int32 bias and the output quantizer
into one ``QGemm`` that writes int8 directly, as it does for a CNN's classifier. This pass rewrites::

    before:  DQ(x_q), DQ(W_q [K, N]) -> MatMul -> Add(DQ(b_q)) -> Q
    after:   x_q -> Reshape[-1, K] -> DQ, DQ(W_q) -> Gemm(C = DQ(b_q)) -> Q -> Reshape[*lead(x_q), N]

The reshapes move quantized integers (no value changes), and ``Gemm(A, B, C) = A·B + C`` is the same sum as
``MatMul + Add``, so the file computes exactly what it did before; the leading sizes are read from ``x_q`` at run
time (``Shape(x_q, end=-1)``), so a dynamic batch or sequence length keeps working. One flattening ``Reshape`` is
shared by every linear reading the same ``x_q`` (e.g. attention's q, k and v projections).

Only the pattern onnxruntime turns into ``QGemm`` is rewritten: 8-bit per-tensor activation, 8-bit per-tensor or
per-output-channel weight stored as a 2-D constant, optional bias ``[N]`` (int32 ``DequantizeLinear`` or float
constant), input rank > 2 (rank-2 linears already export as ``Gemm``). 4-bit, 16-bit, float8 and blocked weights
keep ``MatMul`` (onnxruntime fuses blocked int4 into ``MatMulNBits`` from that form).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, producers_of, readers_of, remove_dead

__all__ = ["linears_to_gemm"]

_EIGHT_BIT = frozenset({TensorProto.INT8, TensorProto.UINT8})


@dataclass(frozen=True)
class _Linear:
    """One matched ``DQ(x) · DQ(W) (+ b) [-> Q]`` site."""

    matmul: onnx.NodeProto
    add: onnx.NodeProto | None
    bias: str | None
    x_quantized: str
    x_dequantize: onnx.NodeProto
    quantize: onnx.NodeProto | None
    out_features: int
    in_features: int


class _Graph:
    """Producer / consumer / initializer / rank lookups over one ``GraphProto``."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.producer = producers_of(graph)
        self.consumers = readers_of(graph)
        self.outputs = {o.name for o in graph.output}
        #: Known shapes: an int per static dimension, a str (its symbol, or "?") per dynamic one.
        self.shapes: dict[str, list[int | str]] = {}
        for value in (*graph.input, *graph.value_info, *graph.output):
            tensor_type = value.type.tensor_type
            if tensor_type.HasField("shape"):
                self.shapes[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                                           for d in tensor_type.shape.dim]

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def numel(self, name: str) -> int | None:
        tensor = self.initializers.get(name)
        return None if tensor is None else int(np.prod(tensor.dims))


def _per_tensor_8bit_dequantize(g: _Graph, node: onnx.NodeProto | None) -> bool:
    """``DequantizeLinear`` with constant scalar scale and 8-bit constant zero point (static activation quantizer)."""
    if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 3:
        return False
    scale, zero_point = node.input[1], node.input[2]
    zp = g.initializers.get(zero_point)
    return (g.numel(scale) == 1 and zp is not None and zp.data_type in _EIGHT_BIT and g.numel(zero_point) == 1
            and not attributes_of(node).get("block_size"))


def _weight_dequantize(g: _Graph, node: onnx.NodeProto | None) -> tuple[int, int] | None:
    """``(K, N)`` of a ``DequantizeLinear`` of a constant 8-bit ``[K, N]`` weight, per-tensor or per-column."""
    if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 3:
        return None
    weight, scale, zero_point = (g.initializers.get(name) for name in node.input[:3])
    if weight is None or scale is None or zero_point is None or len(weight.dims) != 2:
        return None
    if weight.data_type not in _EIGHT_BIT or zero_point.data_type not in _EIGHT_BIT:
        return None
    attrs = attributes_of(node)
    if attrs.get("block_size"):
        return None
    k, n = (int(d) for d in weight.dims)
    count = int(np.prod(scale.dims))
    if count != 1 and not (count == n and int(attrs.get("axis", 1)) % 2 == 1):
        return None
    return k, n


def _bias(g: _Graph, add: onnx.NodeProto, matmul_out: str, n: int) -> str | None:
    """Name of the ``[N]`` bias the ``Add`` adds to the MatMul output (int32 DQ or float constant), else None."""
    if len(add.input) != 2 or matmul_out not in add.input:
        return None
    other = add.input[1] if add.input[0] == matmul_out else add.input[0]
    producer = g.producer.get(other)
    if other in g.initializers:
        tensor = g.initializers[other]
        return other if tensor.data_type == TensorProto.FLOAT and list(tensor.dims) == [n] else None
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    data = g.initializers.get(producer.input[0])
    if data is None or data.data_type != TensorProto.INT32 or list(data.dims) != [n]:
        return None
    return other


def _match(g: _Graph, matmul: onnx.NodeProto) -> _Linear | None:
    if matmul.op_type != "MatMul":
        return None
    x_dq, w_dq = (g.producer.get(name) for name in matmul.input)
    shape = _weight_dequantize(g, w_dq)
    if shape is None or not _per_tensor_8bit_dequantize(g, x_dq):
        return None
    x_quantized = x_dq.input[0]
    if len(g.shapes.get(x_quantized, ())) <= 2:
        return None  # rank-2 linears are Gemm already; unknown rank: leave it
    k, n = shape
    add = g.only_consumer(matmul.output[0])
    bias = _bias(g, add, matmul.output[0], n) if add is not None and add.op_type == "Add" else None
    if bias is None:
        add = None
    out = (add or matmul).output[0]
    quantize = g.only_consumer(out)
    if quantize is not None and quantize.op_type != "QuantizeLinear":
        quantize = None
    return _Linear(matmul, add, bias, x_quantized, x_dq, quantize, n, k)


def linears_to_gemm(model: onnx.ModelProto) -> int:
    """Rewrite each matched rank > 2 quantized ``MatMul (+ Add)`` into ``Reshape -> Gemm -> Reshape``, in place.

    Args:
        model: The exported model (main graph; shapes in ``value_info`` as the dynamo exporter writes them).

    Returns:
        The number of linears rewritten (0: unchanged).
    """
    g = _Graph(model)
    sites = [site for node in g.graph.node if (site := _match(g, node)) is not None]
    if not sites:
        return 0
    new_nodes: dict[str, list[onnx.NodeProto]] = {}  # inserted before the node producing the key's value
    flattened: dict[tuple[str, int], str] = {}
    removed: set[int] = set()
    for site in sites:
        prefix = f"{site.matmul.name or site.matmul.output[0]}_gemm"
        before = new_nodes.setdefault(site.matmul.output[0], [])
        rows = _rows(g.shapes[site.x_quantized])
        key = (site.x_quantized, site.in_features)
        if key not in flattened:
            rows_shape = f"{prefix}_rows_shape"
            g.graph.initializer.append(
                numpy_helper.from_array(np.array([-1, site.in_features], np.int64), rows_shape))
            flat = f"{prefix}_x_2d"
            before.append(helper.make_node("Reshape", [site.x_quantized, rows_shape], [flat],
                                           name=f"{prefix}_flatten"))
            _annotate(g, flat, _quantized_type(g, site.x_dequantize), rows, site.in_features)
            flattened[key] = flat
        flat_dq = f"{prefix}_x_2d_dq"
        before.append(helper.make_node(
            "DequantizeLinear", [flattened[key], *site.x_dequantize.input[1:]], [flat_dq],
            name=f"{prefix}_x_dequantize", axis=int(attributes_of(site.x_dequantize).get("axis", 1)),
        ))
        gemm_out = f"{prefix}_y_2d"
        gemm_inputs = [flat_dq, site.matmul.input[1], *([site.bias] if site.bias else [])]
        before.append(helper.make_node("Gemm", gemm_inputs, [gemm_out], name=prefix))
        _annotate(g, flat_dq, TensorProto.FLOAT, rows, site.in_features)
        _annotate(g, gemm_out, TensorProto.FLOAT, rows, site.out_features)
        # the value to restore to the original shape: the quantized output when a Q follows, else the Gemm output
        final = (site.quantize or site.add or site.matmul).output[0]
        if site.quantize is not None:
            q = site.quantize
            q_2d = f"{prefix}_q_2d"
            before.append(helper.make_node("QuantizeLinear", [gemm_out, *q.input[1:]], [q_2d], name=f"{prefix}_q",
                                           **attributes_of(q)))
            restored_from = q_2d
            _annotate(g, q_2d, _quantized_type(g, q), rows, site.out_features)
            removed.add(id(q))
        else:
            restored_from = gemm_out
        before.extend(_restore_shape(g, site, restored_from, final, prefix))
        removed.add(id(site.matmul))
        if site.add is not None:
            removed.add(id(site.add))
    rebuilt: list[onnx.NodeProto] = []
    for node in g.graph.node:
        rebuilt.extend(new_nodes.get(node.output[0], []) if node.output else [])
        if id(node) not in removed:
            rebuilt.append(node)
    del g.graph.node[:]
    g.graph.node.extend(_topologically_sorted(rebuilt, g))
    remove_dead(g.graph)  # e.g. the 3-D DequantizeLinear the rewritten MatMuls were the last readers of
    return len(sites)


def _rows(dims: list[int | str]) -> int | None:
    """Rows of the flattened ``[rows, K]`` operand: the product of the leading sizes when all are static."""
    lead = dims[:-1]
    return int(np.prod(lead)) if all(isinstance(d, int) for d in lead) else None


def _quantized_type(g: _Graph, node: onnx.NodeProto) -> int:
    """Element type of the integer side of a QuantizeLinear / DequantizeLinear: its zero point's (uint8 if none)."""
    zero_point = g.initializers.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return zero_point.data_type if zero_point is not None else TensorProto.UINT8


def _annotate(g: _Graph, name: str, elem_type: int, rows: int | None, cols: int) -> None:
    """Record the ``[rows, cols]`` shape of a value the pass created (``rows`` None: unknown), for later passes."""
    g.graph.value_info.append(helper.make_tensor_value_info(name, elem_type, [rows, cols]))


def _restore_shape(g: _Graph, site: _Linear, value_2d: str, final: str, prefix: str) -> list[onnx.NodeProto]:
    """Nodes giving ``final = value_2d`` reshaped to ``[*lead(x_q), N]``, the linear's original output shape.

    When at most one leading dimension is symbolic: one ``Reshape`` to a constant shape with ``-1`` there;
    otherwise the leading sizes are read at run time (``Shape -> Concat -> Reshape``).
    """
    dims = g.shapes.get(site.x_quantized)
    target = f"{prefix}_out_shape"
    if dims is not None and sum(not isinstance(d, int) for d in dims[:-1]) <= 1:
        lead = [d if isinstance(d, int) else -1 for d in dims[:-1]]
        g.graph.initializer.append(numpy_helper.from_array(np.array([*lead, site.out_features], np.int64), target))
        return [helper.make_node("Reshape", [value_2d, target], [final], name=f"{prefix}_unflatten")]
    lead, n_name = f"{prefix}_lead_shape", f"{prefix}_out_features"
    g.graph.initializer.append(numpy_helper.from_array(np.array([site.out_features], np.int64), n_name))
    return [
        helper.make_node("Shape", [site.x_quantized], [lead], name=f"{prefix}_lead", end=-1),
        helper.make_node("Concat", [lead, n_name], [target], name=f"{prefix}_out_shape", axis=0),
        helper.make_node("Reshape", [value_2d, target], [final], name=f"{prefix}_unflatten"),
    ]


def _topologically_sorted(nodes: list[onnx.NodeProto], g: _Graph) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every input is produced before it is read (stable: keeps the given order)."""
    available = {t.name for t in g.graph.initializer} | {i.name for i in g.graph.input} | {""}
    pending = list(nodes)
    ordered: list[onnx.NodeProto] = []
    while pending:
        blocked: list[onnx.NodeProto] = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                blocked.append(node)
        if len(blocked) == len(pending):
            raise ValueError(f"linears_to_gemm left a cycle or a missing input at {blocked[0].name!r}")
        pending = blocked
    return ordered

