"""ONNX post-pass: drop a ``Reshape`` whose result only reaches another ``Reshape`` to a fixed shape.

``Reshape`` keeps the elements in row-major order and only changes the shape, and elementwise ops with a scalar
operand (``DequantizeLinear`` / ``QuantizeLinear`` with one scale, ``Gelu``, ``Relu``, ``Mul`` by a constant,
…) do not care about the shape. So in ::

    a -> Reshape(s1) -> DequantizeLinear -> Gelu -> QuantizeLinear -> Reshape(s2) -> …

the first ``Reshape`` can be dropped whenever ``s2`` is a constant without ``0`` ("copy this dimension from the
input") entries: the second one produces the same tensor from ``a`` directly. onnxruntime does not fold such
pairs; each ``Reshape`` left is a kernel launch per run. The pass exists for :mod:`linears_to_gemm`, whose
``[*lead, N] <-> [rows, N]`` reshapes around consecutive linears (``fc1 -> GELU -> fc2``, attention's projections
feeding the head split) cancel this way, but any pair of the exporter's own reshapes collapses too.

Every value on the chain must have a single reader and must not be a graph output, so no other reader sees a
changed shape; the shape annotations (``value_info``) of the values whose shape changes are removed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from coreai_opt.onnx.graph_index import readers_of, remove_dead

__all__ = ["collapse_reshapes"]

#: Ops applied element by element to a single tensor input (other inputs, if any, must be one-element constants).
_ELEMENTWISE = frozenset({
    "Abs", "Cast", "Ceil", "Clip", "DequantizeLinear", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "LeakyRelu", "Log", "Neg", "QuantizeLinear", "Reciprocal", "Relu", "Round", "Selu",
    "Sigmoid", "Sign", "Softplus", "Sqrt", "Tanh", "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow",
})


def _numel(initializers: dict[str, onnx.TensorProto], name: str) -> int | None:
    tensor = initializers.get(name)
    return None if tensor is None else int(np.prod(tensor.dims))


def _is_elementwise_on(node: onnx.NodeProto, value: str, initializers: dict[str, onnx.TensorProto]) -> bool:
    """``node`` reads ``value`` once and every other input is an empty slot or a constant of one element."""
    if node.op_type not in _ELEMENTWISE or list(node.input).count(value) != 1:
        return False
    return all(name == value or name == "" or _numel(initializers, name) == 1 for name in node.input)


def _target(initializers: dict[str, onnx.TensorProto], reshape: onnx.NodeProto) -> list[int] | None:
    """The ``Reshape`` target if it is a constant without 0 entries (the result does not depend on the input shape)."""
    tensor = initializers.get(reshape.input[1]) if len(reshape.input) > 1 else None
    if tensor is None:
        return None
    dims = [int(d) for d in numpy_helper.to_array(tensor).reshape(-1)]
    return None if 0 in dims else dims


def _known_shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Shapes recorded in the graph: an int per static dimension, None per unknown or symbolic one."""
    shapes: dict[str, list[int | None]] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    return shapes


def _is_identity(shape: list[int | None] | None, target: list[int]) -> bool:
    """Whether reshaping a tensor of ``shape`` to ``target`` changes nothing.

    True when the ranks agree and every dimension matches, or is the single unknown one that ``-1`` stands for.
    """
    if shape is None or len(shape) != len(target) or target.count(-1) > 1:
        return False
    unknown = [i for i, d in enumerate(shape) if d is None]
    return all(t == d for t, d in zip(target, shape, strict=True) if d is not None) and (
        not unknown or (len(unknown) == 1 and target[unknown[0]] == -1)
    )


class _Rewriter:
    """One collapse run over a graph: reader lookups are rebuilt after each change."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}
        self.shapes = _known_shapes(graph)
        self.readers: dict[str, list[onnx.NodeProto]] = {}

    def refresh(self) -> None:
        self.readers = readers_of(self.graph)

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        readers = self.readers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.graph_outputs else None

    def forget(self, names: set[str]) -> None:
        """Drop the stale shape annotations of ``names``."""
        kept = [v for v in self.graph.value_info if v.name not in names]
        del self.graph.value_info[:]
        self.graph.value_info.extend(kept)

    def drop_reshape_before_reshape(self, first: onnx.NodeProto) -> bool:
        """Remove ``first`` if its result only reaches a fixed-shape ``Reshape`` through elementwise ops."""
        chain: list[str] = []
        value, reader = first.output[0], self.only_reader(first.output[0])
        while reader is not None and reader.op_type != "Reshape" and _is_elementwise_on(reader, value,
                                                                                      self.initializers):
            value = reader.output[0]
            chain.append(value)
            reader = self.only_reader(value)
        if reader is None or reader.op_type != "Reshape" or reader.input[0] != value:
            return False
        if _target(self.initializers, reader) is None:
            return False
        source, head = first.input[0], self.only_reader(first.output[0])
        head.input[:] = [source if name == first.output[0] else name for name in head.input]
        source_shape = self.shapes.get(source)
        for name in chain:  # elementwise: the chain now carries the source's shape
            self.shapes.pop(name, None)
            if source_shape is not None:
                self.shapes[name] = list(source_shape)
        self.forget({first.output[0], *chain})
        self.graph.node.remove(first)
        return True

    def drop_identity_reshape(self, node: onnx.NodeProto) -> bool:
        """Remove a ``Reshape`` whose input already has the target shape."""
        target = _target(self.initializers, node)
        if target is None or node.output[0] in self.graph_outputs:
            return False
        if not _is_identity(self.shapes.get(node.input[0]), target):
            return False
        for reader in self.readers.get(node.output[0], []):
            reader.input[:] = [node.input[0] if name == node.output[0] else name for name in reader.input]
        self.forget({node.output[0]})
        self.graph.node.remove(node)
        return True


def collapse_reshapes(model: onnx.ModelProto) -> int:
    """Drop the ``Reshape`` nodes that change nothing in the end, in place.

    Those are a ``Reshape`` that only feeds (through single-reader elementwise ops) a fixed-shape ``Reshape``, and
    a ``Reshape`` whose input (by the graph's shape annotations) already has the target shape.

    Args:
        model: An ONNX model (main graph), changed in place.

    Returns:
        The number of ``Reshape`` nodes removed.
    """
    rewriter = _Rewriter(model.graph)
    removed = 0
    changed = True
    while changed:
        changed = False
        rewriter.refresh()
        for node in list(model.graph.node):
            if node.op_type == "Reshape" and (rewriter.drop_reshape_before_reshape(node)
                                              or rewriter.drop_identity_reshape(node)):
                removed += 1
                changed = True
                break
    remove_dead(model.graph)  # the shape constants of the removed reshapes
    return removed

