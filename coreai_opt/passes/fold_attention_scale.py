r"""Fold the constant scale of attention scores into the projection that produces the queries (or keys).

Hand-written attention computes :math:`S = (Q K^\top) / c` (or :math:`(Q K^\top) \cdot c`, as in
``scores = matmul(q, k.transpose(-2, -1)) * scaling``) with :math:`Q = \mathrm{heads}(x W^\top + b)`.
With the scale :math:`s = 1/c` for a division and :math:`s = c` for a multiplication, matrix products are
linear in each operand and head reshapes only move values, so

.. math::

    (Q K^\top)\,s = (Q\,s) K^\top, \qquad \mathrm{heads}(y)\,s = \mathrm{heads}(y\,s), \qquad
    (x W^\top + b)\,s = x\,(W s)^\top + b\,s

and the scale is absorbed by the projection:

.. math::

    W' = W \cdot s, \qquad b' = b \cdot s

after which the ``div`` / ``mul`` node is removed and its users read the ``matmul`` directly. In a quantized
model this removes a quantize → dequantize → div → quantize step per attention block.

Matched pattern (both captures, by :class:`~coreai_opt.graph.op_kinds.OpKind`): a ``DIV`` node ``m / c`` or a
``MUL`` node ``m * c`` / ``c * m`` whose tensor operand ``m`` is a ``MATMUL`` used only by it, where ``c`` is a
Python number or a one-element tensor read by ``get_attr`` (a buffer or a lifted constant, not a trainable
parameter), finite and non-zero. Matmul operand 0 is walked back through value-moving ops
(``MOVER_KINDS``: reshape, view, transpose, permute, contiguous, dropout, ...; max pooling only for
:math:`s > 0`) to a functional ``LINEAR``; operand 1 (the keys) is tried when that fails. Every node on the
path must have exactly one user that reads its values (``x.shape`` / ``x.size()`` queries do not count:
scaling keeps the shape), and the linear's weight and bias must be ``get_attr`` tensors used by nothing else.
The folded tensors are new ``nn.Parameter`` objects on the GraphModule, so the user's model is never changed.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from coreai_opt.graph.graph_attrs import get_attr_value, rescale_weight_and_bias
from coreai_opt.graph.node_meta import get_meta, tensor_info
from coreai_opt.graph.op_kinds import MOVER_KINDS, ArgLayout, OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.shape_queries import value_users

__all__ = ["fold_attention_scale"]


def _constant(gm: GraphModule, value: object) -> float | torch.Tensor | None:
    """The finite, non-zero constant ``value`` stands for (Python number or one-element tensor), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) and number != 0.0 else None
    tensor = get_attr_value(value, gm)
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1 or tensor.requires_grad:
        return None  # not a graph constant, not a scalar, or a trainable parameter (training must keep it)
    if tensor.is_complex() or tensor.dtype == torch.bool:
        return None
    number = float(tensor.detach().reshape(()).item())
    return tensor.detach() if math.isfinite(number) and number != 0.0 else None


def _scaled_matmul(gm: GraphModule, node: Node) -> tuple[Node, float | torch.Tensor, Node | None] | None:
    """Match ``matmul / c``, ``matmul * c`` or ``c * matmul``: return ``(matmul, c, get_attr of c or None)``."""
    kind = get_meta(node).kind
    if kind not in (OpKind.DIV, OpKind.MUL) or node.op not in ("call_function", "call_method"):
        return None
    if len(node.args) != 2 or any(v is not None for v in node.kwargs.values()):  # e.g. rounding_mode="floor"
        return None
    a, b = node.args
    orders = [(a, b)] if kind is OpKind.DIV else [(a, b), (b, a)]  # c / matmul is not a scale
    for matmul, operand in orders:
        if not isinstance(matmul, Node) or get_meta(matmul).kind is not OpKind.MATMUL:
            continue
        if value_users(matmul) != [node] or len(matmul.args) < 2 or matmul.args[0] is matmul.args[1]:
            continue
        value = _constant(gm, operand)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            # A shaped one-element tensor may broadcast to more dims or promote the dtype: fold only when the
            # recorded output of the scaling op has exactly the matmul's shape and dtype.
            before, after = tensor_info(matmul), tensor_info(node)
            if before is None or before != after:
                continue
        return matmul, value, operand if isinstance(operand, Node) else None
    return None


def _projection(gm: GraphModule, start: object, positive: bool) -> Node | None:
    """Walk from a matmul operand through single-user movers back to a functional linear (None if none)."""
    node = start
    while isinstance(node, Node):
        if len(value_users(node)) != 1:
            return None
        kind = get_meta(node).kind
        if kind is OpKind.LINEAR:
            return node if node.op == "call_function" else None
        if kind not in MOVER_KINDS or (kind is OpKind.MAX_POOL and not positive):
            return None  # max(x·s) = s·max(x) needs s > 0
        data = lookup_op(node, gm).layout.data
        if not data:
            return None
        node = ArgLayout.get(node, data[0])
    return None


def _fold_into(gm: GraphModule, linear: Node, scale: float | torch.Tensor, divide: bool) -> bool:
    """Scale ``linear``'s weight and bias by ``1/scale`` (``divide``) or ``scale``; False when it cannot."""
    layout = lookup_op(linear, gm).layout

    def rescale(t: torch.Tensor, _is_bias: bool) -> torch.Tensor:
        factor = scale.to(t.device) if isinstance(scale, torch.Tensor) else scale
        return (t / factor if divide else t * factor).to(t.dtype)

    return rescale_weight_and_bias(gm, linear, ArgLayout.get(linear, layout.weight), ArgLayout.get(linear, layout.bias),
                                   rescale)


def fold_attention_scale(gm: GraphModule) -> PassResult:
    """Fold constant attention-score scales into the q (or k) projection (see the module docstring).

    Args:
        gm: A classified GraphModule whose weighted modules were functionalized.

    Returns:
        ``PassResult`` counting the removed ``div`` / ``mul`` nodes (one per folded attention block).

    Raises:
        ValueError: the graph was not classified.
    """
    changes = 0
    erased: set[Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased:
            continue
        meta = get_meta(node)
        if meta.kind is None and node.op not in ("placeholder", "output"):
            raise ValueError(f"fold_attention_scale needs op kinds on {node.format_node()}; run classify_ops first")
        match = _scaled_matmul(gm, node)
        if match is None:
            continue
        matmul, scale, scale_node = match
        divide = meta.kind is OpKind.DIV
        sign = scale if isinstance(scale, float) else float(scale.reshape(()).item())
        for operand in matmul.args[:2]:
            linear = _projection(gm, operand, positive=sign > 0)
            if linear is not None and _fold_into(gm, linear, scale, divide):
                break
        else:
            continue
        node.replace_all_uses_with(matmul)
        gm.graph.erase_node(node)
        erased.add(node)
        if scale_node is not None and not scale_node.users:
            gm.graph.erase_node(scale_node)
            erased.add(scale_node)
        changes += 1
    return PassResult.after_edits(gm, changes)

