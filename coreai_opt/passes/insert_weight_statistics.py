"""Call each data-aware weight quantizer's input statistics on the input edge of the linear it serves.

A weight quantizer whose spec names a data-aware ``weight_rounding`` (GPTQ needs ``XᵀX`` of the layer input, the
weighted MSE search ``E[x_j²]``) owns an ``InputStatistics`` child at ``<quantizer>.rounding.statistics``. For
every linear whose weight argument is that quantizer's output, this pass inserts, right before the linear::

    x ──► call_module <quantizer>.rounding.statistics ──► linear(·, <quantizer>(W), b)

The call returns its input unchanged (it observes only while calibrating), so no value changes; only the
linear's own input edge is rewired (other readers of ``x`` are untouched). Weights of other ops (convolutions,
embeddings) get no statistics and are rounded by the algorithm's data-free path. Run after
``insert_quantizers``.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import NodeMeta, Role, called_quantizer, copy_provenance, get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.quantization.spec import FakeQuantize

__all__ = ["insert_weight_statistics"]


def _statistics_of(gm: GraphModule, node: Node) -> str | None:
    """``<quantizer>.rounding.statistics`` when ``node`` calls a weight quantizer with input statistics."""
    fq = called_quantizer(gm, node, Role.WEIGHT)
    if fq is None or not fq.rounds_with_data:
        return None
    return f"{node.target}.{FakeQuantize.INPUT_STATISTICS}"


def insert_weight_statistics(gm: GraphModule) -> PassResult:
    """Insert the input-statistics calls described in the module docstring.

    Args:
        gm: A GraphModule after ``insert_quantizers``.

    Returns:
        ``PassResult`` counting inserted calls.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        target = _statistics_of(gm, node)
        if target is None:
            continue
        for user in list(node.users):
            if get_meta(user).kind is not OpKind.LINEAR or len(user.args) < 2 or user.args[1] is not node:
                continue
            x = user.args[0]
            if not isinstance(x, Node):
                continue
            with gm.graph.inserting_before(user):
                call = gm.graph.call_module(target, (x,))
            copy_provenance(x, call)
            set_meta(call, NodeMeta(kind=OpKind.MOVE, module_name=get_meta(user).module_name,
                                    module_type=get_meta(user).module_type))
            user.update_arg(0, call)
            gm.get_submodule(target).attached = True
            changes += 1
    return PassResult.after_edits(gm, changes)
