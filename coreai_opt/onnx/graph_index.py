"""Look-ups over one ONNX graph that every ONNX post-pass needs: who reads a value, who produces it."""

from __future__ import annotations

import onnx

__all__ = ["readers_of", "producers_of"]


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
