"""Linear outputs that no integer kernel reads stay float: onnxruntime's integer linears can write float.

onnxruntime runs ``DQ(x), DQ(W) → MatMul`` without a ``QuantizeLinear`` after it as ``MatMulIntegerToFloat``, and
``DQ(x), DQ(W), DQ(b int32) → Gemm`` as ``QGemm`` with a float output: the int32 accumulator times
:math:`s_x s_W` plus the bias, in float. The linear stays an integer kernel either way, so quantizing its output
only pays where a reader runs an integer kernel on it (``QLinearAdd``, ``QLinearMatMul``, ``QLinearSoftmax``, the
next linear, ...). Where every reader is float (a GELU / SiLU, a LayerNorm, a residual ``Add`` the config keeps
float), the output ``Q → DQ`` pair costs two kernels and a rounding and buys nothing: BERT's
``intermediate.dense → GELU`` and, under a float residual stream, each block's ``attention.output.dense`` and
``output.dense`` (the LayerNorm-outlier tensors that break static int8 MiniLM) lose it.

Convolutions keep their output quantizer (onnxruntime has no integer convolution with a float output: without the
``Q`` it runs a float ``Conv``), and so does a linear whose output spec comes from an ``op_kind`` / module entry
(an explicit request), whose output is a fused activation's, or that the model returns (onnxruntime's own
quantizer quantizes a returned linear output too, and a file's reader may expect it). A reader "reads it
quantized" when its annotation asks for that input edge; movers and identities that share the quantizer pass the
question on to their readers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from torch.fx import Node

from coreai_opt.graph.node_meta import Annotation, QuantSpec, SharedSpec, get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.shape_queries import value_users

__all__ = ["drop_unread_linear_outputs"]


def _sharers_and_readers(node: Node) -> tuple[list[Node], bool]:
    """The nodes sharing ``node``'s quantizer (movers, identities) and whether any reader asks for it."""
    sharers, frontier = [], [node]
    while frontier:
        tensor = frontier.pop()
        for user in value_users(tensor):
            if get_meta(user).kind is OpKind.OUTPUT:
                return sharers, True  # the model output keeps its quantizer, as onnxruntime's quantizer writes it
            annotation = get_meta(user).annotation
            if annotation is None:
                continue
            if any(arg is tensor for arg, _ in annotation.inputs):
                return sharers, True
            if isinstance(annotation.output, SharedSpec) and annotation.output.edge_or_node is tensor:
                sharers.append(user)
                frontier.append(user)
    return sharers, False


def drop_unread_linear_outputs(linears: Iterable[Node]) -> int:
    """Clear the own output spec of each of ``linears`` that no reader asks for (module docstring).

    Args:
        linears: Linear nodes whose output spec came from the global activation spec.

    Returns:
        How many outputs were left float.
    """
    dropped = 0
    for linear in linears:
        meta = get_meta(linear)
        annotation = meta.annotation
        if annotation is None or not isinstance(annotation.output, QuantSpec):
            continue
        sharers, read = _sharers_and_readers(linear)
        if read:
            continue
        # no float_reason: the linear still runs an integer kernel (summary's "left float" lists float ops only)
        set_meta(linear, replace(meta, annotation=Annotation(annotation.inputs, None)))
        for sharer in sharers:
            set_meta(sharer, replace(get_meta(sharer), annotation=None))
        dropped += 1
    return dropped
