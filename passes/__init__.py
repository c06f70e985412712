"""Graph passes of coreai_opt (installed as ``coreai_opt.passes``).

``prepare`` runs them as a recipe::

    capture → classify_ops → functionalize_weights → fold_batchnorm → annotate → insert_quantizers
    → insert_weight_statistics

and ``convert`` runs ``drop_redundant_activations``. Every pass takes the GraphModule the pipeline owns and
returns a :class:`PassResult`; decisions live in ``node.meta["coreai_opt"]`` (:mod:`.node_meta`).
"""

from __future__ import annotations

from coreai_opt.passes.annotate import annotate
from coreai_opt.passes.capture import CaptureError, capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.drop_redundant_activations import drop_redundant_activations
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.functionalize_weights import functionalize_weights
from coreai_opt.passes.insert_quantizers import insert_quantizers
from coreai_opt.passes.insert_weight_statistics import insert_weight_statistics
from coreai_opt.passes.node_meta import META_KEY, NodeMeta, QuantizerInfo, Role, get_meta
from coreai_opt.passes.op_kinds import OpKind, lookup_op
from coreai_opt.passes.pass_result import PassResult

__all__ = [
    "CaptureError",
    "META_KEY",
    "NodeMeta",
    "OpKind",
    "PassResult",
    "QuantizerInfo",
    "Role",
    "annotate",
    "capture",
    "classify_ops",
    "drop_redundant_activations",
    "fold_batchnorm",
    "functionalize_weights",
    "get_meta",
    "insert_quantizers",
    "insert_weight_statistics",
    "lookup_op",
]
