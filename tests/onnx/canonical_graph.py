"""A graph's structure without its value names: two exports of one model compare node for node."""

from __future__ import annotations

import hashlib

import onnx
from onnx import numpy_helper


def canonical_graph(model: onnx.ModelProto) -> list[tuple[object, ...]]:
    """Inputs, nodes (op, domain, attributes, inputs, outputs) and outputs in order, where a computed value is named
    by its position of first appearance and an initializer by its content (dtype, shape, SHA-1 of its values)."""
    graph = model.graph
    constants = {t.name: ("constant", t.data_type, tuple(t.dims),
                          hashlib.sha1(numpy_helper.to_array(t).tobytes()).hexdigest()) for t in graph.initializer}
    index: dict[str, object] = {"": ""}

    def name_of(value: str) -> object:
        if value in constants:
            return constants[value]
        return index.setdefault(value, f"v{len(index)}")

    rows: list[tuple[object, ...]] = [("input", name_of(i.name), str(i.type)) for i in graph.input]
    for node in graph.node:
        attributes = tuple(sorted((a.name, repr(onnx.helper.get_attribute_value(a))) for a in node.attribute))
        rows.append((node.op_type, node.domain, attributes, tuple(name_of(i) for i in node.input),
                     tuple(name_of(o) for o in node.output)))
    rows.extend(("output", name_of(o.name), str(o.type)) for o in graph.output)
    return rows
