"""ONNX post-pass: write a quantized spatial mean as ``GlobalAveragePool`` so onnxruntime runs it on integers.

The exporter writes a CNN's global average pool (``x.mean((2, 3))``, ``adaptive_avg_pool2d(x, 1)``) as
``ReduceMean(axes=[-2, -1])``. Between a ``DequantizeLinear`` and a ``QuantizeLinear`` onnxruntime leaves it in
float (a DQ, a float reduction and a Q at run time); the same mean written as ``GlobalAveragePool`` fuses into
its integer ``QLinearGlobalAveragePool``. The rewrite::

    DQ -> ReduceMean(axes = last two of a 4-D input, keepdims=1) -> Q   ==>   DQ -> GlobalAveragePool -> Q
    DQ -> ReduceMean(..., keepdims=0) -> Q                              ==>   DQ -> GlobalAveragePool -> Q -> Flatten

``GlobalAveragePool`` of ``[N, C, H, W]`` is the mean over ``H, W`` with shape ``[N, C, 1, 1]``; ``Flatten(axis=1)``
moves the quantized ``[N, C, 1, 1]`` to ``[N, C]``. Only 4-D inputs (rank from the graph's shape annotations)
with a per-tensor ``QuantizeLinear`` as the only reader are rewritten.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, producers_of, readers_of, remove_dead

__all__ = ["reduce_mean_to_global_average_pool"]


def _rank(graph: onnx.GraphProto, name: str) -> int | None:
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return None


def _axes(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> list[int] | None:
    attrs = attributes_of(node)
    if "axes" in attrs:  # opset < 18
        return [int(a) for a in attrs["axes"]]
    if len(node.input) > 1 and node.input[1] in initializers:
        return [int(a) for a in numpy_helper.to_array(initializers[node.input[1]]).reshape(-1)]
    return None


def reduce_mean_to_global_average_pool(model: onnx.ModelProto) -> int:
    """Rewrite each quantized spatial ``ReduceMean`` of a 4-D tensor into ``GlobalAveragePool``, in place.

    Args:
        model: The exported model (main graph).

    Returns:
        The number of ``ReduceMean`` nodes rewritten.
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers, producers = readers_of(graph), producers_of(graph)
    graph_outputs = {o.name for o in graph.output}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "ReduceMean" or _rank(graph, node.input[0]) != 4:
            continue
        producer = producers.get(node.input[0])
        users = readers.get(node.output[0], [])
        if producer is None or producer.op_type != "DequantizeLinear" or node.output[0] in graph_outputs:
            continue
        if len(users) != 1 or users[0].op_type != "QuantizeLinear":
            continue
        axes = _axes(node, initializers)
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            continue
        attrs = attributes_of(node)
        pooled = helper.make_node("GlobalAveragePool", [node.input[0]], [node.output[0]], name=f"{node.name}_pool")
        replaced[id(node)] = [pooled]
        if not int(attrs.get("keepdims", 1)):
            quantize = users[0]
            flat_input = f"{quantize.output[0]}_4d"
            replaced[id(quantize)] = [
                helper.make_node("QuantizeLinear", [quantize.input[0], *quantize.input[1:]], [flat_input],
                                 name=quantize.name, **attributes_of(quantize)),
                helper.make_node("Flatten", [flat_input], [quantize.output[0]], name=f"{node.name}_flatten",
                                 axis=1),
            ]
    if not replaced:
        return 0
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        rebuilt.extend(replaced.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(rebuilt)
    stale = {n.output[0] for n in rebuilt if n.op_type == "GlobalAveragePool"}  # [N, C] -> [N, C, 1, 1]
    kept = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    remove_dead(graph)  # the axes constant
    return sum(1 for nodes in replaced.values() if nodes[0].op_type == "GlobalAveragePool")

