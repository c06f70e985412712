"""The parts of a quantized linear that the ``linears_to_gemm`` rule rewrites, and its reshapes.

The rule is :mod:`~coreai_opt.onnx.rewrite.rules.linears_to_gemm`.

A site is ``DQ(x_q) · DQ(W) [+ b] [-> Q]``: the ``MatMul``, the ``Add`` of an ``[N]`` bias (an int32
``DequantizeLinear`` or a float constant) when the MatMul output is read by it alone, and the ``QuantizeLinear``
reading the result alone. The helpers build the ``[*lead, K] -> [rows, K]`` flattening (shared by every linear
reading the same ``x_q``) and the ``[rows, N] -> [*lead, N]`` restoring reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import Dim, OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Match

__all__ = ["LinearSite", "flattened_input", "restore_shape"]


@dataclass(frozen=True)
class LinearSite(Match):
    """One matched ``DQ(x) · DQ(W) (+ b) [-> Q]`` site; :attr:`node` is the ``MatMul``."""

    add: onnx.NodeProto | None
    bias: str | None
    x_quantized: str
    x_dequantize: onnx.NodeProto
    quantize: onnx.NodeProto | None
    out_features: int
    in_features: int

    @classmethod
    def find(cls, matmul: onnx.NodeProto, x_view: QdqView, graph: OnnxGraph, k: int, n: int) -> LinearSite:
        """The site around ``matmul``: its bias ``Add`` and output ``QuantizeLinear`` when present."""
        add = graph.only_reader(matmul.output[0])
        bias = _bias(graph, add, matmul.output[0], n) if add is not None and add.op_type == "Add" else None
        if bias is None:
            add = None
        quantize = graph.only_reader((add or matmul).output[0])
        if quantize is not None and quantize.op_type != "QuantizeLinear":
            quantize = None
        return cls(matmul, add, bias, x_view.data, x_view.node, quantize, n, k)

    def rows(self, graph: OnnxGraph) -> int | None:
        """Rows of the flattened ``[rows, K]`` operand: the product of the leading sizes when all are static."""
        lead = graph.shape(self.x_quantized)[:-1]
        return int(np.prod(lead)) if all(isinstance(d, int) for d in lead) else None


def _bias(graph: OnnxGraph, add: onnx.NodeProto, matmul_out: str, n: int) -> str | None:
    """Name of the ``[N]`` bias the ``Add`` adds to the MatMul output (int32 DQ or float constant), else None."""
    if len(add.input) != 2 or matmul_out not in add.input:
        return None
    other = add.input[1] if add.input[0] == matmul_out else add.input[0]
    tensor = graph.initializer(other)
    if tensor is not None:
        return other if tensor.data_type == TensorProto.FLOAT and list(tensor.dims) == [n] else None
    producer = graph.producer(other)
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    data = graph.initializer(producer.input[0])
    if data is None or data.data_type != TensorProto.INT32 or list(data.dims) != [n]:
        return None
    return other


def flattened_input(site: LinearSite, graph: OnnxGraph, prefix: str, rows: int | None) -> tuple[str, list]:
    """``(name of x_q as [rows, K], new nodes computing it)``; reuses a flattening another linear already added."""
    for reader in graph.readers(site.x_quantized):
        target = graph.constant(reader.input[1]) if reader.op_type == "Reshape" and len(reader.input) > 1 else None
        if target is not None and target.tolist() == [-1, site.in_features] and reader.input[0] == site.x_quantized:
            return reader.output[0], []
    rows_shape = graph.add_initializer(graph.unique_name(f"{prefix}_rows_shape"),
                                       np.array([-1, site.in_features], np.int64))
    flat = graph.unique_name(f"{prefix}_x_2d")
    node = helper.make_node("Reshape", [site.x_quantized, rows_shape], [flat], name=f"{prefix}_flatten")
    quant_type = QdqView.of(site.x_dequantize, graph).quant_type or TensorProto.UINT8
    graph.annotate(flat, quant_type, [rows, site.in_features])
    return flat, [node]


def restore_shape(site: LinearSite, graph: OnnxGraph, value_2d: str, final: str, prefix: str) -> list[onnx.NodeProto]:
    """Nodes giving ``final = value_2d`` reshaped to ``[*lead(x_q), N]``, the linear's original output shape.

    When at most one leading dimension is symbolic: one ``Reshape`` to a constant shape with ``-1`` there;
    otherwise the leading sizes are read at run time: ``Reshape(value_2d, Concat(Shape(source), [N]))``. The
    source is a graph input whose recorded shape is exactly ``lead`` (a transformer's ``input_ids [batch,
    sequence]``; equal symbolic names are equal sizes), so every linear shares one ``Shape`` and one ``Concat``
    per ``N``, and ``x_q`` keeps its single reader (``collapse_reshapes`` can then drop a reshape feeding it);
    without such an input it is ``Shape(x_q, end=-1)`` of the first linear with these leading sizes, shared by
    the later ones (GPT-Neo's ``[batch, Min(64, sequence)]``, which no graph input has: 6 ``Shape`` and 6
    ``Concat`` -> 1 and 2). Sharing keeps the graph acyclic: the first linear's input precedes the later linears.
    """
    dims = graph.shape(site.x_quantized)
    lead = dims[:-1]
    if sum(not isinstance(d, int) for d in lead) <= 1:
        target = graph.unique_name(f"{prefix}_out_shape")
        graph.add_initializer(target, np.array([*(d if isinstance(d, int) else -1 for d in lead),
                                                site.out_features], np.int64))
        return [helper.make_node("Reshape", [value_2d, target], [final], name=f"{prefix}_unflatten")]
    source = _lead_shape_input(graph, lead)
    if source is not None:
        target, new = _shared_out_shape(graph, source, site.out_features, prefix)
        return [*new, helper.make_node("Reshape", [value_2d, target], [final], name=f"{prefix}_unflatten")]
    lead_shape, new = _earlier_lead_shape(graph, lead, site.node), []
    if lead_shape is None:
        lead_shape = graph.unique_name(f"{prefix}_lead_shape")
        new.append(helper.make_node("Shape", [site.x_quantized], [lead_shape], name=f"{prefix}_lead", end=-1))
        graph.annotate(lead_shape, TensorProto.INT64, [len(lead)])
    target, concat = _out_shape(graph, lead_shape, site.out_features, prefix)
    return [*new, *concat, helper.make_node("Reshape", [value_2d, target], [final], name=f"{prefix}_unflatten")]


def _earlier_lead_shape(graph: OnnxGraph, lead: tuple[Dim, ...], before: onnx.NodeProto) -> str | None:
    """The output of a ``Shape(x, end=-1)`` placed before ``before`` whose ``x`` has the leading sizes ``lead``.

    Only nodes before the linear are candidates: in graph (topological) order they cannot depend on its output.
    """
    for node in graph.nodes:
        if node is before:
            return None
        if node.op_type == "Shape" and attributes_of(node) == {"end": -1}:
            dims = graph.shape(node.input[0])
            if dims is not None and tuple(dims[:-1]) == tuple(lead):
                return node.output[0]
    return None


def _lead_shape_input(graph: OnnxGraph, lead: tuple[Dim, ...]) -> str | None:
    """The first graph input (by name) whose recorded shape is exactly ``lead``, every dimension named or fixed."""
    if any(d is None for d in lead):
        return None
    matches = sorted(name for name in graph.inputs if graph.shape(name) == tuple(lead))
    return matches[0] if matches else None


def _shared_out_shape(graph: OnnxGraph, source: str, n: int, prefix: str) -> tuple[str, list[onnx.NodeProto]]:
    """``(name of [*shape(source), n], new nodes)``, reusing the ``Shape`` / ``Concat`` an earlier linear added."""
    new: list[onnx.NodeProto] = []
    shapes = [r for r in graph.readers(source) if r.op_type == "Shape" and not r.attribute]
    if shapes:
        lead_shape = shapes[0].output[0]
    else:
        lead_shape = graph.unique_name(f"{source}_shape")
        new.append(helper.make_node("Shape", [source], [lead_shape], name=graph.unique_node_name(f"{source}_shape")))
        graph.annotate(lead_shape, TensorProto.INT64, [len(graph.shape(source) or ())])
    target, concat = _out_shape(graph, lead_shape, n, prefix)
    return target, [*new, *concat]


def _out_shape(graph: OnnxGraph, lead_shape: str, n: int, prefix: str) -> tuple[str, list[onnx.NodeProto]]:
    """``(name of Concat(lead_shape, [n]), new nodes)``, reusing a ``Concat`` an earlier linear added."""
    for reader in graph.readers(lead_shape):
        if reader.op_type == "Concat" and len(reader.input) == 2 and reader.input[0] == lead_shape:
            tail = graph.constant(reader.input[1])
            if tail is not None and tail.tolist() == [n]:
                return reader.output[0], []
    out_features = graph.shared_constant("linear_out_features", np.array([n], np.int64))
    target = graph.unique_name(f"{prefix}_out_shape")
    return target, [helper.make_node("Concat", [lead_shape, out_features], [target], name=f"{prefix}_out_shape",
                                     axis=0)]
