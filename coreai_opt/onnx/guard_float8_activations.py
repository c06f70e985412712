"""ONNX post-pass: keep ``Relu``/``Clip`` in front of a float8/4-bit ``QuantizeLinear`` from being deleted.

onnxruntime's graph optimizer (``ORT_ENABLE_EXTENDED`` and above) removes a ``Relu`` or ``Clip`` that directly
feeds a ``QuantizeLinear`` whose zero point is 0, on the reasoning that the quantized range already starts at 0.
That holds for uint8 with zero point 0, but not for float8: float8 represents negative values, so after the
rewrite negative activations pass through and the model's outputs change (measured: a digits CNN drops from
99.6 % to 34.9 % accuracy under the fp8 preset, while the unoptimized session matches eager bit for bit). The
same rewrite misfires in front of int4/uint4 quantizers.

This pass rewrites exactly those nodes into the same function spelled with ops the optimizer leaves alone:

* ``Relu(x)`` -> ``Max(x, 0)``
* ``Clip(x, lo, hi)`` -> ``Min(Max(x, lo), hi)`` (only the bounds that are given)

``Max(x, 0)`` equals ``Relu(x)`` for every float, so the exported values do not change.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import unique_name

__all__ = ["guard_float8_activations"]

# float8 and 4-bit integer activations: onnxruntime drops the Relu/Clip in front of these too (measured: int4
# and uint4 are off by 3-27 output steps without the guard, exact with it). uint8/int8/16-bit are handled correctly.
_GUARDED_TYPES = frozenset(
    {
        TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ,
        TensorProto.INT4, TensorProto.UINT4,
    }
)


def _float8_quantize_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names of tensors consumed by a QuantizeLinear whose zero point (an initializer) is float8 or 4-bit."""
    zero_point_types = {init.name: init.data_type for init in graph.initializer}
    return {
        node.input[0]
        for node in graph.node
        if node.op_type == "QuantizeLinear"
        and len(node.input) > 2
        and zero_point_types.get(node.input[2]) in _GUARDED_TYPES
    }


def guard_float8_activations(model: onnx.ModelProto) -> int:
    """Rewrite ``Relu``/``Clip`` nodes that feed a float8 ``QuantizeLinear`` (see the module docstring).

    Args:
        model: The exported model, changed in place.

    Returns:
        The number of nodes rewritten (0 when the model has no float8 activation quantizers).
    """
    graph = model.graph
    guarded = _float8_quantize_inputs(graph)
    if not guarded:
        return 0
    taken = {init.name for init in graph.initializer} | {out for n in graph.node for out in n.output}
    taken |= {n.name for n in graph.node}
    new_nodes: list[onnx.NodeProto] = []
    changes = 0
    for node in graph.node:
        if node.op_type not in ("Relu", "Clip") or node.output[0] not in guarded:
            new_nodes.append(node)
            continue
        changes += 1
        x, out = node.input[0], node.output[0]
        if node.op_type == "Relu":
            zero = unique_name(f"{node.name or out}_zero", taken)
            graph.initializer.append(numpy_helper.from_array(np.array(0.0, dtype=np.float32), zero))
            new_nodes.append(helper.make_node("Max", [x, zero], [out], name=unique_name(f"{node.name}_max", taken)))
            continue
        bounds = [b for b in node.input[1:3]]
        lo = bounds[0] if bounds and bounds[0] else None
        hi = bounds[1] if len(bounds) > 1 and bounds[1] else None
        current = x
        if lo is not None:
            lowered = out if hi is None else unique_name(f"{out}_lower", taken)
            name = unique_name(f"{node.name}_max", taken)
            new_nodes.append(helper.make_node("Max", [current, lo], [lowered], name=name))
            current = lowered
        if hi is not None:
            new_nodes.append(helper.make_node("Min", [current, hi], [out], name=unique_name(f"{node.name}_min", taken)))
        if lo is None and hi is None:
            new_nodes.append(helper.make_node("Identity", [x], [out], name=unique_name(f"{node.name}_identity", taken)))
    del graph.node[:]
    graph.node.extend(new_nodes)
    return changes
