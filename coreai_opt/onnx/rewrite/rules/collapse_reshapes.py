"""Rule: drop the ``Reshape`` nodes that change nothing in the end.

``Reshape`` keeps the elements in row-major order and only changes the shape, and elementwise ops with a scalar
operand (``DequantizeLinear`` / ``QuantizeLinear`` with one scale, ``Gelu``, ``Relu``, ``Mul`` by a constant,
…) do not care about the shape. So in ::

    a -> Reshape(s1) -> DequantizeLinear -> Gelu -> QuantizeLinear -> Reshape(s2) -> …

the first ``Reshape`` can be dropped whenever ``s2`` is a constant without ``0`` ("copy this dimension from the
input") entries: the second one produces the same tensor from ``a`` directly. A ``Reshape`` whose input (by the
graph's shape annotations) already has the target shape is dropped too. onnxruntime does not fold such
reshapes; each one left is a kernel launch per run. The rule exists for :mod:`linears_to_gemm`, whose
``[*lead, N] <-> [rows, N]`` reshapes around consecutive linears (``fc1 -> GELU -> fc2``, attention's projections
feeding the head split) cancel this way, and runs only after it rewrote something.

Every value on the chain must have a single reader and must not be a graph output, so no other reader sees a
changed shape; the shape annotations (``value_info``) of the values whose shape changes are removed. The graph is
rescanned from the start after each removal (a removal can make an earlier ``Reshape`` removable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from coreai_opt.onnx.rewrite.graph import Dim, OnnxGraph
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["CollapseReshapes"]

#: Ops applied element by element to a single tensor input (other inputs, if any, must be one-element constants).
_ELEMENTWISE = frozenset({
    "Abs", "Cast", "Ceil", "Clip", "DequantizeLinear", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "LeakyRelu", "Log", "Neg", "QuantizeLinear", "Reciprocal", "Relu", "Round", "Selu",
    "Sigmoid", "Sign", "Softplus", "Sqrt", "Tanh", "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow",
})


@dataclass(frozen=True)
class _Site(Match):
    chain: tuple[str, ...]  # values between the dropped Reshape and the Reshape that fixes the shape; () = identity


def _is_elementwise_on(node: onnx.NodeProto, value: str, graph: OnnxGraph) -> bool:
    """``node`` reads ``value`` once and every other input is an empty slot or an initializer of one element."""
    if node.op_type not in _ELEMENTWISE or list(node.input).count(value) != 1:
        return False
    return all(name in (value, "") or _numel(graph, name) == 1 for name in node.input)


def _numel(graph: OnnxGraph, name: str) -> int | None:
    tensor = graph.initializer(name)
    return None if tensor is None else math.prod(tensor.dims)


def _target(graph: OnnxGraph, reshape: onnx.NodeProto) -> list[int] | None:
    """The target of a ``Reshape`` if it is an initializer without 0 entries (independent of the input's shape)."""
    name = reshape.input[1] if len(reshape.input) > 1 else ""
    value = graph.constant(name) if graph.initializer(name) is not None else None
    if value is None:
        return None
    dims = [int(d) for d in value.reshape(-1)]
    return None if 0 in dims else dims


def _is_identity(shape: tuple[Dim, ...] | None, target: list[int]) -> bool:
    """Whether reshaping a tensor of ``shape`` to ``target`` changes nothing.

    True when the ranks agree and every dimension matches, or is the single unknown one that ``-1`` stands for.
    """
    if shape is None or len(shape) != len(target) or target.count(-1) > 1:
        return False
    known = [d if isinstance(d, int) else None for d in shape]
    unknown = [i for i, d in enumerate(known) if d is None]
    return all(t == d for t, d in zip(target, known, strict=True) if d is not None) and (
        not unknown or (len(unknown) == 1 and target[unknown[0]] == -1)
    )


class CollapseReshapes(Rule):
    """Drop a ``Reshape`` cancelled by a later fixed-shape ``Reshape``, or one that keeps its input's shape."""

    name = "collapse_reshapes"
    anchors = frozenset({"Reshape"})
    restart_after_rewrite = True
    only_after = "linears_to_gemm"

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``Reshape`` reaching a fixed-shape ``Reshape`` through single-reader elementwise ops, or a no-op one."""
        chain: list[str] = []
        value, reader = node.output[0], graph.only_reader(node.output[0])
        while reader is not None and reader.op_type != "Reshape" and _is_elementwise_on(reader, value, graph):
            value = reader.output[0]
            chain.append(value)
            reader = graph.only_reader(value)
        if reader is not None and reader.op_type == "Reshape" and reader.input[0] == value:
            if _target(graph, reader) is not None:
                return _Site(node, tuple(chain))
            near_miss = f"the Reshape it reaches ({reader.name or reader.output[0]}) has no fixed target shape"
        else:
            near_miss = None
        target = _target(graph, node)
        if target is not None and node.output[0] not in graph.outputs and _is_identity(graph.shape(node.input[0]),
                                                                                       target):
            return _Site(node, ())
        return Fail(near_miss) if near_miss else None

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Remove the ``Reshape``; its readers read its input (whose shape the chain now carries)."""
        node = match.node
        source, output = node.input[0], node.output[0]
        graph.forget_shapes({output, *match.chain})
        source_shape = graph.shape(source)
        for name in match.chain:  # elementwise: the chain now carries the source's shape
            graph.set_known_shape(name, source_shape)
        graph.replace_uses(output, source)
        graph.remove(node)
