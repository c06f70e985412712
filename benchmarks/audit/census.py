"""What one optimized graph runs: integer kernels, Q/DQ left, and the float ops between integer kernels.

The graph is onnxruntime's own optimized dump (``ORT_ENABLE_ALL``, CPU provider, 1 thread), so what is counted is
what runs. A float op is *between integer kernels* when it lies on a data path that leaves the integer domain and
comes back: it is reachable from a ``DequantizeLinear`` output (or the float output of an integer kernel such as
``MatMulIntegerToFloat``) and it reaches a ``QuantizeLinear`` input (or the float input of such a kernel) without
crossing another quantization boundary. ``Shape`` reads no values and ends a path. These are the ops a better
placement could remove or run as integers; float ops before the first quantizer or after the last one are not.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import onnx

from coreai_opt.onnx.verify.fusion_report import INTEGER_COMPUTE_OPS

__all__ = ["GraphCensus", "census"]

#: Integer kernels that read quantized tensors and write float ones (the integer domain ends at their output).
_FLOAT_OUT = frozenset({"MatMulIntegerToFloat", "MatMulNBits", "DynamicQuantizeMatMul", "QAttention",
                        "QEmbedLayerNormalization"})
#: Ops that enter the integer domain (their float inputs end a float path).
_QUANTIZE = frozenset({"QuantizeLinear", "DynamicQuantizeLinear"})
_OTHER_INTEGER = frozenset({"NhwcMaxPool", "QEmbedLayerNormalization", "QOrderedMatMul"})
_LAYOUT = frozenset({"ReorderInput", "ReorderOutput"})  # NCHWc layout conversions (counted apart)


def _is_integer_kernel(op: str) -> bool:
    return op in INTEGER_COMPUTE_OPS or op.startswith("QLinear") or op in _OTHER_INTEGER


@dataclass(frozen=True)
class GraphCensus:
    """Counts of one optimized graph (see the module docstring).

    Attributes:
        integer_compute: Integer conv / matmul kernels (``QLinearConv``, ``QLinearMatMul``, ``QGemm``, ...).
        other_integer: Other integer kernels (``QLinearAdd``, ``QLinearConcat``, ``QLinearGlobalAveragePool``, ...).
        quantize: ``QuantizeLinear`` / ``DynamicQuantizeLinear`` nodes left.
        dequantize: ``DequantizeLinear`` nodes left.
        float_between: Float ops between integer kernels, by op type.
        layout: NCHWc reorders (``ReorderInput`` / ``ReorderOutput``).
        ops: Every op type of the graph.
    """

    integer_compute: int
    other_integer: int
    quantize: int
    dequantize: int
    float_between: dict[str, int]
    layout: int
    ops: dict[str, int]

    @property
    def integer_kernels(self) -> int:
        """All integer kernels, conv / matmul and the others."""
        return self.integer_compute + self.other_integer

    @property
    def num_float_between(self) -> int:
        """Number of float ops between integer kernels."""
        return sum(self.float_between.values())


def census(model: onnx.ModelProto) -> GraphCensus:
    """Count what the optimized ``model`` runs (module docstring)."""
    nodes = list(model.graph.node)
    consumers: dict[str, list[int]] = defaultdict(list)
    producer: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            if name:
                consumers[name].append(index)
        for name in node.output:
            producer[name] = index

    def is_float_op(node: onnx.NodeProto) -> bool:
        return not (_is_integer_kernel(node.op_type) or node.op_type in _QUANTIZE
                    or node.op_type == "DequantizeLinear" or node.op_type == "Shape")

    # forward from where float values leave the integer domain
    downstream: set[int] = set()
    stack = [c for i, n in enumerate(nodes) if n.op_type == "DequantizeLinear" or n.op_type in _FLOAT_OUT
             for out in n.output for c in consumers[out]]
    while stack:
        index = stack.pop()
        if index in downstream or not is_float_op(nodes[index]):
            continue
        downstream.add(index)
        stack += [c for out in nodes[index].output for c in consumers[out]]
    # backward from where float values enter it
    upstream: set[int] = set()
    stack = [producer[name] for n in nodes if n.op_type in _QUANTIZE or n.op_type in _FLOAT_OUT
             for name in n.input if name in producer]
    while stack:
        index = stack.pop()
        if index in upstream or not is_float_op(nodes[index]):
            continue
        upstream.add(index)
        stack += [producer[name] for name in nodes[index].input if name in producer]
    between = Counter(nodes[i].op_type for i in downstream & upstream if nodes[i].op_type not in _LAYOUT)
    ops = Counter(n.op_type for n in nodes)
    return GraphCensus(
        integer_compute=sum(v for op, v in ops.items() if op in INTEGER_COMPUTE_OPS),
        other_integer=sum(v for op, v in ops.items() if op not in INTEGER_COMPUTE_OPS and _is_integer_kernel(op)),
        quantize=sum(ops[op] for op in _QUANTIZE),
        dequantize=ops["DequantizeLinear"],
        float_between=dict(between),
        layout=sum(ops[op] for op in _LAYOUT),
        ops=dict(ops),
    )
