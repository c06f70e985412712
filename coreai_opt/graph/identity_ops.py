"""Nodes that return their input tensor unchanged in the mode a graph is prepared in, and how to see past them.

``nn.Identity`` and eval-mode dropouts sit inside real blocks (timm's ``BatchNormAct2d`` is
``bn → drop (Identity) → act``): the export emits no op for them, so a rule that looks at "the op after this one"
must look past them, as onnxruntime will.
"""

from __future__ import annotations

from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.shape_queries import value_users

__all__ = ["is_identity", "skip_identities"]


def is_identity(gm: GraphModule, node: Node) -> bool:
    """True for a node that returns its input tensor unchanged in the mode the graph is prepared in.

    ``nn.Identity``; a dropout module (``nn.Dropout``, ``nn.Dropout2d``, ...) with ``p = 0`` or in eval mode; a
    functional dropout called with ``training=False`` (``F.dropout(x, p, training=False)``, ``aten.dropout``).
    A dropout that trains (QAT) scales the values kept by ``1 / (1 − p)``, off the grid, so it is not one.
    """
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Identity):
            return True
        return isinstance(module, nn.modules.dropout._DropoutNd) and (module.p == 0 or not module.training)
    if node.op == "call_function" and get_meta(node).kind is OpKind.DROPOUT:
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
        return training is False
    return False


def skip_identities(gm: GraphModule, node: Node) -> Node:
    """The last node of the chain ``node → identity → identity ...`` in which each link is the only value reader.

    Returns ``node`` itself when its only value reader is not an identity (or it has several readers).
    """
    while len(users := value_users(node)) == 1 and users[0].args and users[0].args[0] is node \
            and is_identity(gm, users[0]):
        node = users[0]
    return node
