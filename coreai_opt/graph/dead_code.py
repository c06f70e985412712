"""Delete nodes nothing reads, but only those proven free of side effects.

``torch.fx.Graph.eliminate_dead_code`` treats ``x.add_(y)``, ``F.relu(x, inplace=True)`` and any module call as
pure, so an in-place op whose *result* is unused (its effect is the write into ``x``) is deleted and the model
silently changes. Every pass that removes nodes uses :func:`remove_dead_nodes` instead: a node goes only when it
has no users and :func:`~coreai_opt.graph.op_effects.is_pure` proves that its result is its only effect.

A torch.export capture checks a value's dtype before each ``.float()`` / ``.to(...)`` with an
``aten._assert_tensor_metadata`` node. Such a check reads the value but computes nothing from it, so a value whose
only readers are these checks is dead, and goes with them (transformers' MRA attention on CPU: the key and value
projections, cast to float for a kernel that is absent and never read, were kept alive by their checks alone).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from coreai_opt.graph.op_effects import is_pure

__all__ = ["remove_dead_nodes"]

_METADATA_CHECK = torch.ops.aten._assert_tensor_metadata.default


def _only_checked(node: Node) -> bool:
    """``node`` has no reader but metadata checks of it (or no reader at all)."""
    return all(user.op == "call_function" and user.target is _METADATA_CHECK
                                    for user in node.users)


def remove_dead_nodes(gm: GraphModule) -> int:
    """Erase every unused pure node (users first, so whole dead chains go in one sweep).

    Args:
        gm: The GraphModule; its graph is changed in place (call ``gm.recompile()`` afterwards).

    Returns:
        The number of nodes erased.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         x.add_(1)      # unused result, but it writes into x
        ...         _ = x * 2      # unused and pure
        ...         return x
        >>> gm = torch.fx.symbolic_trace(M())
        >>> remove_dead_nodes(gm), [str(n.target) for n in gm.graph.nodes]
        (1, ['x', 'add_', 'output'])
    """
    erased = 0
    for node in reversed(list(gm.graph.nodes)):
        if _only_checked(node) and is_pure(gm, node):
            checks = list(node.users)
            for check in checks:
                gm.graph.erase_node(check)
            gm.graph.erase_node(node)
            erased += len(checks) + 1
    return erased
