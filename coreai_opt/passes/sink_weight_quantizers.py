"""An eager-run view of a quantized model that computes each fake-quantized weight just before its first reader.

``torch.export`` places a graph's parameters (``get_attr``) at its top and ``insert_quantizers`` calls each
weight quantizer right after its weight, so an eager forward of the converted model fake-quantizes every weight
early and keeps every weight-sized result alive until its layer runs: a full extra copy of the weights (1.0x of a
1.1 B decoder's fp32 weights during ``export_onnx``'s output count and ``verify_onnx``'s reference forward,
issue 20). :func:`eager_order` returns a view (same submodules and parameters, a copy of the graph) in which each
weight-quantizer call sits right before the first node reading it, so each result is freed as soon as its layer
ran. The values are the same; only the order of independent nodes differs. The model itself is not reordered:
the exporter traces it, and the ONNX node order (the file's bytes) follows the traced order.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.graph.pass_result import PassResult

__all__ = ["sink_weight_quantizers", "eager_order"]


def _is_weight_quantizer(node: Node) -> bool:
    info = get_meta(node).quantizer
    return node.op == "call_module" and info is not None and info.role is Role.WEIGHT


def sink_weight_quantizers(gm: GraphModule) -> PassResult:
    """Move every weight-quantizer call (in place) right before the first node that reads it.

    Args:
        gm: A GraphModule with quantizers inserted.

    Returns:
        The same module; ``changes`` counts the calls moved.
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    moved = 0
    for node in [n for n in gm.graph.nodes if _is_weight_quantizer(n)]:
        if not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if node.next is first:
            continue
        first.prepend(node)
        moved += 1
    return PassResult.after_edits(gm, moved)


def eager_order(model: nn.Module) -> nn.Module:
    """``model`` itself, or for a GraphModule whose weight quantizers run early, a view that runs them late.

    The view shares every submodule and parameter with ``model`` (only the graph is copied).
    """
    if not isinstance(model, GraphModule) or not any(_is_weight_quantizer(n) for n in model.graph.nodes):
        return model
    view = GraphModule(model, copy.deepcopy(model.graph), class_name=type(model).__name__)
    view.meta = model.meta
    return view if sink_weight_quantizers(view).changes else model
