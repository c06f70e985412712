"""ONNX post-pass: store ``Transpose``-d constant weights already transposed, so ``DequantizeLinear`` feeds MatMul.

The exporter writes ``nn.Linear`` on a 3-D input as ``MatMul(x, Transpose(W))`` with ``W`` of shape ``[N, K]``.
With quantized weights that is ``DequantizeLinear(W_q) -> Transpose -> MatMul``, and onnxruntime's fusions look
for ``DequantizeLinear -> MatMul`` with a ``[K, N]`` weight (e.g. blocked int4 -> ``MatMulNBits``). Transposing a
constant before or after dequantizing gives the same floats (DequantizeLinear is elementwise), so this pass stores
``W_q`` transposed, transposes a per-block scale / zero point the same way, moves the quantization axis
(``axis=a`` -> ``1 - a``), and drops the ``Transpose``.

Only 2-D constant weights whose ``DequantizeLinear`` output is read by that single ``Transpose(perm=[1, 0])`` are
rewritten; a blocked scale or zero point shared with other weights gets a transposed copy of its own.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, readers_of

__all__ = ["transpose_dequantized_weights"]


def _axis(node: onnx.NodeProto) -> tuple[int, int]:
    attrs = attributes_of(node)
    return int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))


def _set_axis(node: onnx.NodeProto, axis: int) -> None:
    for attr in node.attribute:
        if attr.name == "axis":
            attr.i = axis
            return
    node.attribute.append(helper.make_attribute("axis", axis))


def _transposed(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(tensor).T), name)


def transpose_dequantized_weights(model: onnx.ModelProto) -> int:
    """Rewrite ``DequantizeLinear(W_q) -> Transpose(perm=[1, 0])`` on constant 2-D weights, in place.

    Args:
        model: The exported model (main graph).

    Returns:
        The number of weights rewritten (0: unchanged).
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    consumers = readers_of(graph)
    graph_outputs = {o.name for o in graph.output}
    removed: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in initializers:
            continue
        users = consumers.get(node.output[0], [])
        if len(users) != 1 or users[0].op_type != "Transpose" or node.output[0] in graph_outputs:
            continue
        transpose = users[0]
        perm = [int(p) for a in transpose.attribute if a.name == "perm" for p in a.ints]
        data = initializers[node.input[0]]
        qparams = [initializers.get(name) for name in node.input[1:] if name]
        if len(data.dims) != 2 or perm != [1, 0] or any(q is None for q in qparams):
            continue
        if len(consumers[node.input[0]]) != 1:
            continue  # a shared weight cannot be transposed for one user only
        axis, block_size = _axis(node)
        data.CopyFrom(_transposed(data, data.name))
        for index, q in enumerate(qparams, start=1):
            if not block_size or len(q.dims) != 2:
                continue
            if len(consumers[q.name]) == 1:
                q.CopyFrom(_transposed(q, q.name))
            else:  # shared (e.g. one all-zero zero point for many weights): give this weight its own copy
                copy_name = f"{data.name}_{'scale' if index == 1 else 'zero_point'}_t"
                graph.initializer.append(_transposed(q, copy_name))
                node.input[index] = copy_name
        if any(len(q.dims) >= 1 and int(np.prod(q.dims)) > 1 for q in qparams):
            _set_axis(node, 1 - axis % 2)
        node.output[0] = transpose.output[0]
        removed.append(transpose)
    for node in removed:
        graph.node.remove(node)
    return len(removed)
