r"""ONNX post-pass: keep onnxruntime from fusing ops around a 4-bit activation ``QuantizeLinear``.

onnxruntime's QDQ optimizer (``ORT_ENABLE_EXTENDED`` and above) turns ``DQ -> Conv -> Q`` into ``QLinearConv``
(likewise ``QGemm``, ``QLinearMatMul``, ``QLinearAdd``, ...) without checking the quantized type; for int4/uint4
activations it builds a node it then rejects, and the session refuses the file:

    INVALID_GRAPH : Type 'tensor(uint4)' of input parameter ... of operator (QLinearConv) ... is invalid

Its QDQ propagation also moves a 4-bit ``DequantizeLinear`` past ``MaxPool`` / ``Reshape`` / ``Transpose``, which
then get 4-bit inputs they have no kernel for. The file itself is valid (it runs bit-exact with the optimizer off).
This pass puts ``Max(x, lowest float32)``, which no fusion or propagation pattern matches, on both sides of every
int4/uint4 *activation* quantizer: between the producing op and the ``QuantizeLinear`` (unless the producer is a
``DequantizeLinear`` or a ``Max``/``Min`` of :mod:`coreai_opt.onnx.guard_float8_activations`) and after the
``DequantizeLinear``. Weight ``DequantizeLinear`` nodes (stored inputs: ``MatMulNBits`` for int4 weights) are left
alone. No value changes: :math:`\max(x, -3.4\cdot10^{38}) = x` for every float except :math:`-\infty`, which
quantizes to ``qmin`` either way, and a ``DequantizeLinear`` output is always finite.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import unique_name

__all__ = ["guard_4bit_activations"]

_FOUR_BIT = frozenset({TensorProto.INT4, TensorProto.UINT4})
_UNFUSED_PRODUCERS = frozenset({"DequantizeLinear", "Max", "Min"})


def guard_4bit_activations(model: onnx.ModelProto) -> int:
    """Put ``Max(x, lowest)`` on both sides of every int4/uint4 activation quantizer (see the module docstring).

    Args:
        model: The exported model, changed in place.

    Returns:
        The number of guards inserted (0 when the model has no 4-bit activation quantizers).
    """
    graph = model.graph
    zero_point_types = {init.name: init.data_type for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}

    def four_bit(node: onnx.NodeProto, op_type: str) -> bool:
        return (node.op_type == op_type and len(node.input) > 2 and zero_point_types.get(node.input[2]) in _FOUR_BIT
                and node.input[0] in producers)  # an activation: its input is computed, not a stored weight

    before = [n for n in graph.node
              if four_bit(n, "QuantizeLinear") and producers[n.input[0]].op_type not in _UNFUSED_PRODUCERS]
    after = [n for n in graph.node if four_bit(n, "DequantizeLinear")]
    if not before and not after:
        return 0
    taken = {init.name for init in graph.initializer} | set(producers) | {n.name for n in graph.node}
    taken |= {i.name for i in graph.input} | {o.name for o in graph.output}
    lowest = unique_name("four_bit_guard_lowest", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(np.finfo(np.float32).min, dtype=np.float32), lowest))
    inserted: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> guards placed right before / after it
    for node in before:
        guarded = unique_name(f"{node.input[0]}_guarded", taken)
        name = unique_name(f"{node.name}_guard", taken)
        guard = helper.make_node("Max", [node.input[0], lowest], [guarded], name=name)
        node.input[0] = guarded
        inserted[id(node)] = [guard, node]
    for node in after:
        raw = unique_name(f"{node.output[0]}_unguarded", taken)
        name = unique_name(f"{node.name}_guard", taken)
        guard = helper.make_node("Max", [raw, lowest], [node.output[0]], name=name)
        node.output[0] = raw
        inserted[id(node)] = [*inserted.get(id(node), [node]), guard]
    ordered = [n for node in graph.node for n in inserted.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(ordered)
    return len(before) + len(after)
