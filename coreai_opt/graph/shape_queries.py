"""Users that read only a tensor's metadata (shape, rank, dtype, device), never its values.

A rewrite that keeps a tensor's shape and dtype (folding a BatchNorm into the conv before it, scaling a projection)
may ignore such users: they read the same answer before and after. Recognised forms, both captures:

* FX: ``getattr(x, "shape" | "ndim" | "dtype" | "device" | "is_cuda")`` and the methods
  ``x.size()``, ``x.dim()``, ``x.numel()``, ``x.nelement()``, ``x.ndimension()``;
* torch.export: ``aten.sym_size``, ``aten.sym_numel``, ``aten.sym_stride``, ``aten.dim``, ``aten.size``.

``torch._assert(x.ndim == 4, ...)`` (timm's ``BatchNormAct2d``) reads ``x`` only through such a ``getattr`` node.
``y.expand_as(x)``, ``y.view_as(x)`` and ``y.reshape_as(x)`` read the values of ``y`` and only the shape of ``x``
(:func:`reads_only_metadata`).
"""

from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["is_shape_query", "reads_only_metadata", "value_users"]

aten = torch.ops.aten

_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension"})
_SHAPE_OF_ARGUMENT = frozenset({"expand_as", "view_as", "reshape_as"})  # y.<method>(x): the shape of x
_SHAPE_PACKETS = (aten.sym_size, aten.sym_numel, aten.sym_stride, aten.dim, aten.size)


def is_shape_query(user: Node) -> bool:
    """True when ``user`` reads only the shape / metadata of its first argument, never the values."""
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) > 1 and user.args[1] in _SHAPE_ATTRS
    if user.op == "call_method":
        return str(user.target) in _SHAPE_METHODS
    packet = getattr(user.target, "overloadpacket", None)
    return user.op == "call_function" and packet is not None and packet in _SHAPE_PACKETS


def value_users(node: Node) -> list[Node]:
    """Users of ``node`` that read its values (every user that is not a shape query)."""
    return [user for user in node.users if not is_shape_query(user)]


def reads_only_metadata(user: Node, node: Node) -> bool:
    """True when ``user`` reads ``node`` for its metadata only: a shape query of it, or ``y.expand_as(node)``."""
    if is_shape_query(user):
        return bool(user.args) and user.args[0] is node
    if user.op == "call_method" and str(user.target) in _SHAPE_OF_ARGUMENT:
        return bool(user.args) and user.args[0] is not node and node not in user.kwargs.values()
    return False
