"""Rewrite weighted ``call_module`` nodes into their functional form with ``get_attr`` weights.

FX tracing keeps ``nn.Conv2d`` as ``call_module(conv1)(x)``; torch.export gives
``aten.conv2d.default(x, get_attr(conv1.weight), get_attr(conv1.bias), ...)``. After this pass an FX graph
has the same shape as an exported one::

    call_module conv1(x)   ->   F.conv2d(x, get_attr conv1.weight, get_attr conv1.bias, stride, padding,
                                         dilation, groups)

so that a weight quantizer can be inserted on the ``get_attr`` edge and patterns are written once. The
parameters stay where they were (``conv1.weight``), so ``state_dict`` keys do not change. Modules whose
``forward`` is overridden, and convolutions with a non-zero ``padding_mode``, are left alone (reason recorded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import NodeMeta, copy_provenance, get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult

__all__ = ["functionalize_weights"]

_CONV_FN: dict[type, Callable[..., Any]] = {
    nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d,
    nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}


def _functional_call(module: nn.Module) -> tuple[Callable[..., Any], tuple[Any, ...]] | str:
    """Return ``(function, trailing args)`` reproducing ``module.forward``, or the reason it cannot."""
    base = next((cls for cls in (*_CONV_FN, nn.Linear, nn.Embedding) if isinstance(module, cls)), None)
    if base is None:
        return f"{type(module).__name__} has no functional form"
    if type(module).forward is not base.forward:
        return f"{type(module).__name__} overrides forward"
    if isinstance(module, nn.Linear):
        return F.linear, ()
    if isinstance(module, nn.Embedding):
        return F.embedding, (module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq,
                             module.sparse)
    if module.padding_mode != "zeros":
        return f"padding_mode={module.padding_mode!r} is not supported (only 'zeros')"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return _CONV_FN[base], (module.stride, module.padding, module.output_padding, module.groups,
                                module.dilation)
    return _CONV_FN[base], (module.stride, module.padding, module.dilation, module.groups)


def functionalize_weights(gm: GraphModule) -> PassResult:
    """Replace Conv*/ConvTranspose*/Linear/Embedding ``call_module`` nodes by functional calls.

    Args:
        gm: A classified GraphModule (``classify_ops`` ran).

    Returns:
        ``PassResult`` counting the rewritten modules.

    Raises:
        ValueError: the graph was not classified.

    Example:
        >>> import torch
        >>> from coreai_opt.passes.capture import capture
        >>> from coreai_opt.passes.classify_ops import classify_ops
        >>> gm = classify_ops(capture(nn.Sequential(nn.Linear(2, 3)), (torch.randn(1, 2),))).graph_module
        >>> functionalize_weights(gm).changes, [n.op for n in gm.graph.nodes]
        (1, ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output'])
    """
    changes = 0
    for node in list(gm.graph.nodes):
        meta = get_meta(node)
        if node.op != "call_module":
            continue
        if meta.kind is None:
            raise ValueError(f"functionalize_weights needs op kinds on {node.format_node()}; run classify_ops first")
        if meta.kind not in (OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.LINEAR, OpKind.EMBEDDING):
            continue
        module = gm.get_submodule(str(node.target))
        call = _functional_call(module)
        if isinstance(call, str) or len(node.args) != 1 or node.kwargs:
            reason = call if isinstance(call, str) else "called with extra arguments"
            set_meta(node, replace(meta, float_reason=f"{node.target} kept as a module call: {reason}"))
            continue
        function, trailing = call
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            set_meta(weight, NodeMeta(kind=OpKind.PARAMETER, module_name=meta.module_name,
                                      module_type=meta.module_type))
            bias: Node | None = None
            if getattr(module, "bias", None) is not None:
                bias = gm.graph.get_attr(f"{node.target}.bias")
                set_meta(bias, NodeMeta(kind=OpKind.PARAMETER, module_name=meta.module_name,
                                        module_type=meta.module_type))
            if function is F.embedding:
                args: tuple[Any, ...] = (node.args[0], weight, *trailing)
            else:
                args = (node.args[0], weight, bias, *trailing)
            new = gm.graph.call_function(function, args)
        copy_provenance(node, new)
        set_meta(new, replace(meta, kind=lookup_op(new, gm).kind))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changes += 1
    return PassResult.after_edits(gm, changes)
