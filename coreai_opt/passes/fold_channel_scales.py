r"""Fold a constant per-channel scale that multiplies a convolution's or linear's output into its weights.

Layer scale (ConvNeXt, CaiT, DeiT-III, PoolFormer, ...) multiplies a branch's last projection by a learned vector
:math:`g` before the residual add: :math:`y = g \odot (W x + b)`. Each output channel :math:`c` is scaled by one
number, so

.. math::

    g_c \, (W_c \cdot x + b_c) = (g_c W_c) \cdot x + g_c b_c, \qquad W'_c = g_c W_c, \quad b'_c = g_c b_c

(:math:`W_c` the weights of output channel :math:`c`: row ``c`` of a linear's ``[out, in]`` weight, filter ``c``
of a convolution's ``[out, in / groups, *k]``), and the ``mul`` node is removed. Quantized, the multiply was one
more integer kernel per block (``QLinearMul``) and one more rounding: the convolution's output was quantized, then
the product again; onnxruntime's own quantizer gets the same fold from its float optimizer (``Conv → Mul`` fusion).

Matched pattern (by :class:`~coreai_opt.graph.op_kinds.OpKind`): a ``MUL`` node ``y * g`` / ``g * y`` whose tensor
operand ``y`` is a functional ``CONV`` or ``LINEAR`` (canonical weight layout) read by it alone (``x.shape`` queries
do not count), directly or through identities (``nn.Identity``, an eval-mode dropout: timm's ``Mlp.drop2``) each
read by the next alone, where ``g`` is a constant tensor read by ``get_attr``, directly or through one ``reshape`` /
``view`` with constant sizes (timm's ``x.mul(self.gamma.reshape(1, -1, 1, 1))``), finite, whose shape broadcasts
along the output channel axis only (1 for a convolution, the last for a linear; a single number scales every
channel) and leaves the product's recorded shape and dtype those of ``y``. The weight and bias must be ``get_attr``
tensors used by nothing else. The products are computed in float64 and rounded once. The folded tensors are new
``nn.Parameter`` objects on the GraphModule, so the user's model is never changed; ``g`` itself stays for its other
readers. QAT keeps the multiply (``g`` trains on its own there): ``prepare`` runs this pass for post-training
quantization only.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from coreai_opt.graph.graph_attrs import get_attr_value, rescale_weight_and_bias
from coreai_opt.graph.identity_ops import is_identity, skip_identities
from coreai_opt.graph.node_meta import get_meta, tensor_info
from coreai_opt.graph.op_kinds import ArgLayout, OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.shape_queries import value_users

__all__ = ["fold_channel_scales"]

_RESHAPES = frozenset({"reshape", "view", torch.reshape, torch.ops.aten.reshape.default, torch.ops.aten.view.default})


def _constant(gm: GraphModule, value: object) -> tuple[torch.Tensor, Node | None, Node] | None:
    """``(value, reshape node or None, get_attr node)`` for a constant operand, possibly reshaped once."""
    if not isinstance(value, Node):
        return None
    reshape = None
    sizes: tuple[object, ...] = ()
    if value.op in ("call_method", "call_function") and value.target in _RESHAPES and len(value.users) == 1:
        sizes = tuple(value.args[1:])
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = tuple(sizes[0])
        if value.kwargs or not sizes or not all(isinstance(s, int) for s in sizes):
            return None
        reshape, value = value, value.args[0]
    if not isinstance(value, Node) or value.op != "get_attr":
        return None
    tensor = get_attr_value(value, gm)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or not bool(tensor.isfinite().all()):
        return None
    tensor = tensor.detach()
    return (tensor.reshape(*sizes) if reshape is not None else tensor), reshape, value


def _channel_factors(producer: Node, product: Node, scale: torch.Tensor) -> torch.Tensor | None:
    """The ``[C]`` factors when ``scale`` multiplies each output channel of ``producer`` by one number, else None."""
    info = tensor_info(producer)
    if info is None or info != tensor_info(product) or not info[0] or scale.dim() > len(info[0]):
        return None
    shape = info[0]
    axis = 1 if get_meta(producer).kind is OpKind.CONV else len(shape) - 1
    if axis >= len(shape):
        return None
    padded = (1,) * (len(shape) - scale.dim()) + tuple(scale.shape)
    if any(size != 1 for i, size in enumerate(padded) if i != axis) or padded[axis] not in (1, shape[axis]):
        return None
    return scale.reshape(-1).expand(shape[axis]).to(torch.float64)


def _producer(gm: GraphModule, scaled: object) -> Node | None:
    """The functional conv / linear whose output ``scaled`` is, directly or through identities it alone reads."""
    if not isinstance(scaled, Node):
        return None
    producer = scaled
    while is_identity(gm, producer) and producer.args and isinstance(producer.args[0], Node):
        producer = producer.args[0]
    if producer.op != "call_function" or get_meta(producer).kind not in (OpKind.CONV, OpKind.LINEAR) \
            or skip_identities(gm, producer) is not scaled:
        return None
    return producer


def _fold(gm: GraphModule, producer: Node, factors: torch.Tensor) -> bool:
    """Scale ``producer``'s weight rows (filters) and bias by ``factors``; False when it cannot."""
    layout = lookup_op(producer, gm).layout
    if layout.weight_axes is not None:
        return False  # a [in, out] weight (addmm): not the canonical layout

    def rescale(t: torch.Tensor, is_bias: bool) -> torch.Tensor | None:
        per_channel = t.shape == factors.shape if is_bias else t.dim() >= 2 and t.shape[0] == factors.numel()
        if not per_channel:
            return None  # not one bias entry / weight row (filter) per output channel
        return (t.to(torch.float64) * factors.reshape(-1, *([1] * (t.dim() - 1)))).to(t.dtype)

    return rescale_weight_and_bias(gm, producer, ArgLayout.get(producer, layout.weight),
                                   ArgLayout.get(producer, layout.bias), rescale)


def fold_channel_scales(gm: GraphModule) -> PassResult:
    """Fold constant per-channel multiplies of conv / linear outputs into their weights (module docstring).

    Args:
        gm: A classified GraphModule whose weighted modules were functionalized.

    Returns:
        ``PassResult`` counting the removed ``mul`` nodes.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        if get_meta(node).kind is not OpKind.MUL or node.op not in ("call_function", "call_method") \
                or len(node.args) != 2 or node.kwargs:
            continue
        for scaled, operand in (node.args, node.args[::-1]):
            producer = _producer(gm, scaled)
            if producer is None or value_users(scaled) != [node]:
                continue
            constant = _constant(gm, operand)
            factors = _channel_factors(producer, node, constant[0]) if constant is not None else None
            if factors is None or not _fold(gm, producer, factors):
                continue
            node.replace_all_uses_with(scaled)
            gm.graph.erase_node(node)
            for leftover in constant[1:]:
                if leftover is not None and not leftover.users:
                    gm.graph.erase_node(leftover)
            changes += 1
            break
    if changes:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changes)
