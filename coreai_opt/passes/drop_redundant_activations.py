r"""Remove relu / relu6 / hardtanh nodes whose output quantizer already clamps identically.

A frozen quantizer ``Q`` is monotone, so for an activation ``clamp(x, lo, hi)`` read only by ``Q``:

.. math::

    Q(\mathrm{clamp}(x, lo, hi)) = Q(x) \;\forall x
    \iff Q(lo) = Q(-\infty) \text{ and } Q(hi) = Q(+\infty)

i.e. the lowest representable value ``(qmin − zp)·s`` is ≥ ``lo`` after rounding (relu: ``zp == qmin``) and
the highest is ≤ ``hi`` (relu6: the top of the range ≤ 6). The check evaluates the quantizer itself on
``[lo, −1e30, hi, 1e30]``, so it is exact for the real qparams. This is what onnxruntime's own quantizer
does to let ``DQ → Conv → Q`` fuse into QLinearConv. Only frozen (export-mode) per-tensor quantizers qualify.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.quantization.spec import FakeQuantize, PerTensor

__all__ = ["drop_redundant_activations"]

_CLAMPS = {OpKind.RELU: (0.0, math.inf), OpKind.RELU6: (0.0, 6.0)}


def _bounds(gm: GraphModule, node: Node, kind: OpKind) -> tuple[float, float] | None:
    if kind in _CLAMPS:
        return _CLAMPS[kind]
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return (float(module.min_val), float(module.max_val)) if isinstance(module, nn.Hardtanh) else None
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
    return (float(lo), float(hi)) if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else None


def _redundant(fq: FakeQuantize, lo: float, hi: float) -> bool:
    if not fq.export_mode or not isinstance(fq.spec.granularity, PerTensor) or fq.spec.dtype_info.is_float:
        return False
    probe = torch.tensor([lo if math.isfinite(lo) else -1e30, -1e30, hi if math.isfinite(hi) else 1e30, 1e30])
    with torch.no_grad():
        q = fq(probe)
    return bool(q[0] == q[1]) and bool(q[2] == q[3])


def drop_redundant_activations(gm: GraphModule) -> PassResult:
    """Bypass every relu/relu6/hardtanh whose only user is a frozen quantizer that clamps the same way.

    Args:
        gm: A converted GraphModule (quantizers in export mode).

    Returns:
        ``PassResult`` counting removed activations.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        kind = get_meta(node).kind
        if kind not in (OpKind.RELU, OpKind.RELU6, OpKind.HARDTANH) or len(node.users) != 1:
            continue
        user = next(iter(node.users))
        if user.op != "call_module" or get_meta(user).quantizer is None or user.args != (node,):
            continue
        fq = gm.get_submodule(str(user.target))
        bounds = _bounds(gm, node, kind)
        if not isinstance(fq, FakeQuantize) or bounds is None or not _redundant(fq, *bounds):
            continue
        source = node.args[0]
        user.replace_input_with(node, source)
        gm.graph.erase_node(node)
        changes += 1
    if changes:
        remove_dead_nodes(gm)
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changes)
