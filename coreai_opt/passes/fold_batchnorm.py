r"""Fold an inference-mode BatchNorm into the convolution that feeds it.

With :math:`\sigma = \sqrt{\mathrm{var} + \epsilon}` and per-channel factor :math:`k = \gamma / \sigma`:

.. math::

    W' = W \cdot k \quad (\text{along the output-channel axis}), \qquad b' = (b - \mu)\,k + \beta

The output-channel axis is 0 for ``conv`` (weight ``[out, in/g, *k]``) and 1 for ``conv_transpose``
(weight ``[in, out/g, *k]``, with groups handled block by block). A missing conv bias is treated as 0 and a
bias parameter is added; ``affine=False`` means :math:`\gamma = 1, \beta = 0`.

Recognised BatchNorm forms (both captures): ``call_module`` BatchNorm1d/2d/3d with running statistics,
``F.batch_norm(..., training=False)``, ``aten.batch_norm.default(..., training=False)`` and
``aten._native_batch_norm_legit_no_training.default`` (whose ``getitem(·, 0)`` is the output). Folding
happens for post-training quantization *and* for QAT: ``prepare(qat=True)`` trains the folded convolution
(BN statistics frozen into the weights, the usual "freeze BN" recipe), so the prepared and converted models
compute the same function. Users that read only the conv output's shape or dtype (``x.ndim``, ``x.shape``,
``x.size()``, ``aten.sym_size``, e.g. timm's ``_assert(x.ndim == 4)`` in ``BatchNormAct2d``; see
:mod:`~coreai_opt.graph.shape_queries`) do not block the fold: they keep reading the conv node, whose output
after folding is the BN output, of the same shape and dtype. A bias-free conv gets its bias argument added
whether the call passed ``None`` or left it out (``aten.conv2d.default(x, w)`` from torch.export). A conv whose
output has other users, a weight shared with another op, or a BN without running statistics is left alone and the
reason is recorded on the BN node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.graph.graph_attrs import bind_parameter, get_attr_value, split_target
from coreai_opt.graph.node_meta import get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.shape_queries import value_users

__all__ = ["fold_batchnorm"]

aten = torch.ops.aten


@dataclass(frozen=True)
class _BNParams:
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    mean: torch.Tensor
    var: torch.Tensor
    eps: float


def _bn_params(gm: GraphModule, bn: Node) -> _BNParams | str:
    """Read the BN parameters of any recognised form, or return why it cannot fold."""
    if bn.op == "call_module":
        module = gm.get_submodule(str(bn.target))
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
            return "batch norm without running statistics"
        return _BNParams(module.weight, module.bias, module.running_mean, module.running_var, module.eps)
    target = bn.target
    args = list(bn.args)
    if target is torch.nn.functional.batch_norm:
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    elif target is aten.batch_norm.default:
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        defaults = {}
    elif target is aten._native_batch_norm_legit_no_training.default:
        names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
        defaults = {"training": False}
    else:
        return f"unsupported batch norm target {target}"
    values = {**defaults, **dict(zip(names, args, strict=False)), **bn.kwargs}
    if values.get("training"):
        return "batch norm called with training=True"
    mean, var = get_attr_value(values.get("running_mean"), gm), get_attr_value(values.get("running_var"), gm)
    if mean is None or var is None:
        return "running statistics are not graph attributes"
    return _BNParams(get_attr_value(values.get("weight"), gm), get_attr_value(values.get("bias"), gm), mean, var,
                     float(values.get("eps", 1e-5)))


def _bn_output(bn: Node) -> Node | str:
    """The node whose value is the BN result (the ``getitem(·, 0)`` of the tuple-returning aten form)."""
    if bn.target is not aten._native_batch_norm_legit_no_training.default:
        return bn
    outs = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
    others = [u for u in bn.users if u not in outs and u.users]
    if len(outs) != 1 or others:
        return "batch norm statistics outputs are used"
    return outs[0]


def _bias_arg(conv: Node) -> object:
    """The conv's bias argument (position 2 or keyword ``bias``; None when absent)."""
    return conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")


def _set_bias_arg(conv: Node, bias: Node) -> None:
    """Point the conv's bias slot at ``bias``, appending the argument when the call left it out.

    ``aten.conv2d.default(x, w)`` (torch.export of a bias-free conv) and ``F.conv2d(x, w, stride=2)`` pass
    only two positional arguments; the bias is the third in every conv signature.
    """
    if len(conv.args) > 2:
        conv.update_arg(2, bias)
    elif "bias" in conv.kwargs:
        conv.update_kwarg("bias", bias)
    else:
        conv.args = (*conv.args[:2], bias)


def _fold_one(gm: GraphModule, conv: Node, bn: Node) -> str | None:
    """Fold ``bn`` into ``conv``; return None on success or the reason it was skipped."""
    kind = get_meta(conv).kind
    if kind not in (OpKind.CONV, OpKind.CONV_TRANSPOSE) or conv.op != "call_function":
        return "its input is not a functional convolution"
    readers = value_users(conv)
    if readers != [bn]:
        return f"conv '{conv.name}' output has {len(readers)} users"
    weight_node = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
    bias_node = _bias_arg(conv)
    if not isinstance(weight_node, Node) or weight_node.op != "get_attr" or len(weight_node.users) != 1:
        return "conv weight is not a get_attr used only by this conv"
    if bias_node is not None and (not isinstance(bias_node, Node) or bias_node.op != "get_attr"
                                  or len(bias_node.users) != 1):
        return "conv bias is not a get_attr used only by this conv"
    params = _bn_params(gm, bn)
    if isinstance(params, str):
        return params
    out = _bn_output(bn)
    if isinstance(out, str):
        return out
    weight = get_attr_value(weight_node, gm).detach()
    with torch.no_grad():
        k = (params.gamma.detach() if params.gamma is not None else 1.0) / torch.sqrt(params.var + params.eps)
        k = k.to(weight.dtype)
        if kind is OpKind.CONV:
            folded_w = weight * k.reshape(-1, *[1] * (weight.dim() - 1))
        else:  # conv_transpose: weight [in, out/g, *k], output channel o = g * out_g + j
            index = 8 if conv.target is aten.convolution.default else 6
            groups = int(conv.args[index]) if len(conv.args) > index else 1
            in_g, out_g = weight.shape[0] // groups, weight.shape[1]
            blocks = weight.reshape(groups, in_g, out_g, *weight.shape[2:])
            folded_w = (blocks * k.reshape(groups, 1, out_g, *[1] * (weight.dim() - 2))).reshape(weight.shape)
        bias = get_attr_value(bias_node, gm).detach() if bias_node is not None else torch.zeros_like(k)
        beta = params.beta.detach() if params.beta is not None else torch.zeros_like(k)
        folded_b = (bias - params.mean) * k + beta
    bind_parameter(gm, str(weight_node.target), folded_w)
    if bias_node is None:
        owner = split_target(weight_node.target)[0]
        name = "bias" if getattr(gm.get_submodule(owner), "bias", None) is None else "folded_bias"
        target = f"{owner}.{name}" if owner else name
        gm.get_submodule(owner).register_parameter(name, nn.Parameter(folded_b))
        with gm.graph.inserting_before(conv):
            bias_node = gm.graph.get_attr(target)
        set_meta(bias_node, replace(get_meta(weight_node)))
        _set_bias_arg(conv, bias_node)
    else:
        bind_parameter(gm, str(bias_node.target), folded_b)
    out.replace_all_uses_with(conv)
    for node in (out, bn) if out is not bn else (bn,):
        if not node.users:
            gm.graph.erase_node(node)
    return None


def fold_batchnorm(gm: GraphModule) -> PassResult:
    """Fold every foldable BatchNorm into its preceding conv / conv-transpose (see the module docstring).

    Args:
        gm: A classified GraphModule whose weighted modules were functionalized.

    Returns:
        ``PassResult`` counting folded BatchNorms. Unfolded ones carry ``NodeMeta.float_reason``.

    Raises:
        ValueError: the graph was not classified.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        meta = get_meta(node)
        if meta.kind is None and node.op not in ("placeholder", "output"):
            raise ValueError(f"fold_batchnorm needs op kinds on {node.format_node()}; run classify_ops first")
        if meta.kind is not OpKind.BATCH_NORM:
            continue
        producer = node.args[0] if node.args else None
        reason = _fold_one(gm, producer, node) if isinstance(producer, Node) else "its input is not a graph node"
        if reason is None:
            changes += 1
        else:
            set_meta(node, replace(meta, float_reason=f"batch norm '{meta.module_name or node.name}' not folded: "
                                                      f"{reason}"))
    if changes:
        remove_dead_nodes(gm)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changes)

