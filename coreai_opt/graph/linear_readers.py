"""Which linear layers read a tensor, and their constant weights: one answer for SmoothQuant and calibration search.

A *linear* is a node the op table classifies as ``OpKind.LINEAR`` with its operands in the graph (``F.linear``,
``aten.linear``); its weight is *constant* when it is a ``get_attr`` node, possibly behind a weight quantizer
call (a prepared graph). A ``call_module`` ``nn.Linear`` hides its weight and is not counted.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from coreai_opt.graph.op_kinds import ArgLayout, OpKind, lookup_op

__all__ = ["linear_bias", "linear_readers", "linear_weight"]


def _operand(node: Node, gm: GraphModule, which: str) -> Node | None:
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method"):
        return None
    entry = lookup_op(node, gm)
    if entry.kind is not OpKind.LINEAR:
        return None
    value = ArgLayout.get(node, getattr(entry.layout, which))
    if isinstance(value, Node) and value.op == "call_module" and lookup_op(value, gm).kind is OpKind.QUANTIZE:
        value = value.args[0]
    return value if isinstance(value, Node) and value.op == "get_attr" else None


def linear_weight(node: Node, gm: GraphModule) -> Node | None:
    """The ``get_attr`` node of a linear's constant weight (None: ``node`` is no linear, or the weight is computed)."""
    return _operand(node, gm, "weight")


def linear_bias(node: Node, gm: GraphModule) -> Node | None:
    """The ``get_attr`` node of a linear's constant bias (None: no linear, no bias or a computed one)."""
    return _operand(node, gm, "bias") if linear_weight(node, gm) is not None else None


def linear_readers(x: Node, gm: GraphModule) -> list[Node]:
    """The linears with a constant weight that read ``x`` as their input, in ``x.users`` order."""
    readers = []
    for user in x.users:
        if linear_weight(user, gm) is not None and ArgLayout.get(user, lookup_op(user, gm).layout.data[0]) is x:
            readers.append(user)
    return readers
