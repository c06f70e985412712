r"""Rotate-half rotary in an exported graph: the pattern and the graph's own ``cos`` / ``sin`` tables.

Used by :mod:`~coreai_opt.onnx.rewrite.rules.attention_to_group_query_attention`. The exporter writes Hugging
Face's rotate-half rotary as

.. math::

    \mathrm{rot}(x) = x \odot \cos + [-x_{D/2:}, x_{:D/2}] \odot \sin

(``Slice / Neg / Concat / Mul / Add``); :func:`rotate_half_of` recognises it over the whole head and
:func:`rotary_tables` evaluates the subgraph from ``position_ids`` to ``cos`` / ``sin`` with onnxruntime, so a
kernel's cos / sin caches equal what the graph computes at each position (rotary scaling included).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of

__all__ = ["ancestors", "rotary_tables", "rotate_half_of"]


def _op(node: onnx.NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _ints(graph: OnnxGraph, name: str) -> list[int] | None:
    value = graph.constant(name)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def rotate_half_of(graph: OnnxGraph, rotated: str, half: int) -> tuple[str, str, str] | None:
    """``(x, cos, sin)`` when ``rotated = x · cos + [-x[D/2:], x[:D/2]] · sin`` (rotate-half over the whole head)."""
    add = graph.producer(rotated)
    if not _op(add, "Add"):
        return None
    for first, second in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
        plain, turned = graph.producer(first), graph.producer(second)
        if not (_op(plain, "Mul") and _op(turned, "Mul")):
            continue
        for x, cos in (plain.input, plain.input[::-1]):
            for swapped, sin in (turned.input, turned.input[::-1]):
                concat = graph.producer(swapped)
                if not _op(concat, "Concat") or len(concat.input) != 2 or attributes_of(concat).get("axis") not in (
                        -1, 3):
                    continue
                neg, low = graph.producer(concat.input[0]), graph.producer(concat.input[1])
                high = graph.producer(neg.input[0]) if _op(neg, "Neg") else None
                if _slice(graph, low, x, 0, half) and _slice(graph, high, x, half, None):
                    return x, cos, sin
    return None


def _slice(graph: OnnxGraph, node: onnx.NodeProto | None, x: str, start: int, end: int | None) -> bool:
    """``node`` is ``Slice(x)[..., start:end]`` on the last axis (``end`` None: to the end)."""
    if not _op(node, "Slice") or node.input[0] != x or len(node.input) < 4:
        return False
    starts, ends, axes = (_ints(graph, name) for name in node.input[1:4])
    steps = _ints(graph, node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    if starts != [start] or axes not in ([3], [-1]) or steps != [1] or ends is None or len(ends) != 1:
        return False
    return ends[0] == end if end is not None else ends[0] >= 2 * start


def ancestors(graph: OnnxGraph, names: list[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes computing ``names`` (graph order) and the graph inputs they read."""
    nodes: dict[int, onnx.NodeProto] = {}
    inputs: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        node = graph.producer(name)
        if node is None:
            if name in graph.inputs:
                inputs.add(name)
            continue
        if id(node) not in nodes:
            nodes[id(node)] = node
            stack += [n for n in node.input if n]
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    return sorted(nodes.values(), key=lambda n: order[id(n)]), inputs


def rotary_tables(graph: OnnxGraph, cos: str, sin: str, position_ids: str, max_positions: int,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The graph's ``cos`` / ``sin`` at positions ``0 .. max_positions - 1`` (onnxruntime), ``(positions, D)``."""
    import onnxruntime as ort

    nodes, _ = ancestors(graph, [cos, sin])
    produced = {o for n in nodes for o in n.output}
    constants = sorted({i for n in nodes for i in n.input if i and i not in produced and i != position_ids})
    initializers = [onnx.numpy_helper.from_array(graph.constant(name), name) for name in constants]
    model = helper.make_model(
        helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info(position_ids, TensorProto.INT64, [1, None])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (cos, sin)],
                          initializers),
        opset_imports=[helper.make_opsetid("", 21)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    positions = np.arange(max_positions, dtype=np.int64)[None]
    cos_value, sin_value = session.run([cos, sin], {position_ids: positions})
    return cos_value.reshape(max_positions, -1), sin_value.reshape(max_positions, -1)
