"""The graph passes of coreai_opt, one pass per file (their shared helpers are :mod:`coreai_opt.graph`).

``prepare`` runs them in the order its module docstring lists (:mod:`coreai_opt.api.prepare`, the one copy of the
recipe), and ``convert`` runs ``drop_redundant_activations`` then ``drop_requantizations``. Passes that delete nodes use
:func:`~coreai_opt.graph.dead_code.remove_dead_nodes` (never ``Graph.eliminate_dead_code``, which deletes in-place
ops whose result is unused); captured graphs are :class:`~coreai_opt.graph.savable_graph_module.SavableGraphModule`
so that ``torch.save`` / ``pickle`` keep them whole. Every pass takes the GraphModule the pipeline owns and
returns a :class:`PassResult`; decisions live in ``node.meta["coreai_opt"]`` (:mod:`coreai_opt.graph.node_meta`).
"""

from __future__ import annotations

from coreai_opt.graph.capture_error import InplaceAliasError, ShapeGuardError
from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.graph.node_meta import META_KEY, NodeMeta, QuantizerInfo, Role, get_meta
from coreai_opt.graph.op_kinds import OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.savable_graph_module import SavableGraphModule
from coreai_opt.passes.annotate import annotate
from coreai_opt.passes.capture import CaptureError, capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.decompose_attention import decompose_attention
from coreai_opt.passes.drop_redundant_activations import drop_redundant_activations
from coreai_opt.passes.drop_requantizations import drop_requantizations
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.functionalize_inplace import functionalize_inplace
from coreai_opt.passes.functionalize_weights import functionalize_weights
from coreai_opt.passes.insert_quantizers import insert_quantizers
from coreai_opt.passes.insert_weight_statistics import insert_weight_statistics
from coreai_opt.passes.int8_compute_inputs import int8_compute_inputs

__all__ = [
    "CaptureError",
    "InplaceAliasError",
    "META_KEY",
    "NodeMeta",
    "OpKind",
    "PassResult",
    "QuantizerInfo",
    "Role",
    "SavableGraphModule",
    "ShapeGuardError",
    "annotate",
    "capture",
    "classify_ops",
    "decompose_attention",
    "drop_redundant_activations",
    "drop_requantizations",
    "fold_batchnorm",
    "functionalize_inplace",
    "functionalize_weights",
    "get_meta",
    "insert_quantizers",
    "insert_weight_statistics",
    "int8_compute_inputs",
    "lookup_op",
    "remove_dead_nodes",
]
