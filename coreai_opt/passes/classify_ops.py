"""Record the :class:`~coreai_opt.graph.op_kinds.OpKind` of every node in its NodeMeta."""

from __future__ import annotations

from dataclasses import replace

from torch.fx import GraphModule

from coreai_opt.graph.node_meta import get_meta, set_meta
from coreai_opt.graph.op_kinds import lookup_op
from coreai_opt.graph.pass_result import PassResult

__all__ = ["classify_ops"]


def classify_ops(gm: GraphModule) -> PassResult:
    """Write ``NodeMeta.kind`` for every node from the op table.

    Args:
        gm: A captured GraphModule.

    Returns:
        ``PassResult`` whose ``changes`` counts the nodes whose kind was set or changed.

    Example:
        >>> import torch
        >>> from coreai_opt.passes.capture import capture
        >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()), (torch.randn(1, 2),))
        >>> result = classify_ops(gm)
        >>> result.changes, [get_meta(n).kind.value for n in gm.graph.nodes]
        (4, ['input', 'linear', 'gelu', 'output'])
    """
    changes = 0
    for node in gm.graph.nodes:
        meta = get_meta(node)
        kind = lookup_op(node, gm).kind
        if meta.kind is not kind:
            set_meta(node, replace(meta, kind=kind))
            changes += 1
    return PassResult(gm, changes)
