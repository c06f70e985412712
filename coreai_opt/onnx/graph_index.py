"""Graph look-ups and clean-up shared by the ONNX post-passes.

Who reads a value, who produces it, a node's attributes, a fresh name, and removing what a rewrite left unused.
"""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["readers_of", "producers_of", "attributes_of", "remove_dead", "unique_name"]


def readers_of(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Map each value name to the nodes that read it, in graph order (a node reading it twice is listed twice)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def producers_of(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Map each node output name to the node producing it."""
    return {name: node for node in graph.node for name in node.output}


def attributes_of(node: onnx.NodeProto) -> dict[str, object]:
    """The node's attributes as ``{name: Python value}``."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def remove_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is read (repeatedly), then initializers nothing reads, in place."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        keep = [node for node in graph.node if any(name in used for name in node.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = {name for node in graph.node for name in node.input} | outputs
    if any(t.name not in used for t in graph.initializer):
        kept = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept)


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first not in ``taken`` (which is updated)."""
    candidate, i = base, 0
    while candidate in taken:
        i += 1
        candidate = f"{base}_{i}"
    taken.add(candidate)
    return candidate
