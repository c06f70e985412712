"""ONNX post-pass: remove conv / gemm biases that are exactly zero.

Folding a BatchNorm whose shift is zero (``β = μ·γ/σ``, e.g. a freshly initialised BN) gives a convolution an
all-zero bias, which the export stores as an int32 ``DequantizeLinear`` input. onnxruntime then adds it to every
output element of its integer kernel; adding zero changes no value, so the input is dropped (``Conv`` and ``Gemm``
take the bias as an optional last input). Only constant biases whose every element is 0 are removed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from coreai_opt.onnx.graph_index import producers_of, remove_dead

__all__ = ["drop_zero_biases"]

#: Op type -> index of its optional bias input.
_BIAS_INPUT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}


def _constant_zero(name: str, initializers: dict[str, onnx.TensorProto],
                   producers: dict[str, onnx.NodeProto]) -> bool:
    """``name`` is an all-zero initializer, or a ``DequantizeLinear`` of one (zero point 0 or absent)."""
    if name in initializers:
        return not np.any(numpy_helper.to_array(initializers[name]))
    producer = producers.get(name)
    if producer is None or producer.op_type != "DequantizeLinear" or producer.input[0] not in initializers:
        return False
    zero_point = producer.input[2] if len(producer.input) > 2 else ""
    if zero_point and (zero_point not in initializers or np.any(numpy_helper.to_array(initializers[zero_point]))):
        return False
    return not np.any(numpy_helper.to_array(initializers[producer.input[0]]))


def drop_zero_biases(model: onnx.ModelProto) -> int:
    """Remove all-zero constant bias inputs of ``Conv`` / ``ConvTranspose`` / ``Gemm``, in place.

    Args:
        model: The exported model (main graph).

    Returns:
        The number of biases removed. ``DequantizeLinear`` nodes and initializers left unused are removed too.
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = producers_of(graph)
    dropped = 0
    for node in graph.node:
        index = _BIAS_INPUT.get(node.op_type)
        if index is None or len(node.input) <= index or not node.input[index]:
            continue
        if _constant_zero(node.input[index], initializers, producers):
            del node.input[index]
            dropped += 1
    if dropped:
        remove_dead(graph)
    return dropped
