"""Does a value-moving op keep every element under the qparam it had? (per-channel / per-block sharing).

A per-tensor quantizer may be shared across any value-moving op (reshape, permute, max-pool, ...): every element
keeps the one scale. A per-channel or per-block quantizer has one qparam per index ``r`` of its layout, and the
same module called on the mover's output applies its axis to the *output's* shape. Sharing is exact only when
every element lands under the qparam it left, i.e. with ``I(t)`` the tensor holding at each element the row
index of its qparam (``I = expand(arange(R).reshape(qparam_shape(t)))``):

    mover(I(x)) == I(mover(x))   and   qparam_shape(mover(x)) == qparam_shape(x)

The test runs the mover on ``I(x)`` (float64, exact for any index below 2**53) with the example shapes. It
holds for dropout, max-pool over spatial axes and reshapes that keep the axis in place; it fails for ``flatten``
of the channel axis into features, a ``permute`` that moves the axis, or a slice along it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from coreai_opt.graph.node_meta import get_meta, tensor_info
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.quantization.spec import Granularity

__all__ = ["keeps_qparam_layout"]

#: Largest example tensor the test builds (elements); a larger one is judged not to keep its layout.
_MAX_ELEMENTS = 1 << 24


def _row_index(granularity: Granularity, shape: tuple[int, ...]) -> torch.Tensor:
    """``I(t)`` of a tensor of ``shape``: each element's qparam row index (module docstring)."""
    qshape = granularity.qparam_shape(shape)
    rows = torch.arange(math.prod(qshape), dtype=torch.float64).reshape(qshape)
    return granularity.expand(rows, torch.empty(shape, dtype=torch.float64)).expand(shape)


def _run(mover: Node, source: Node, value: torch.Tensor) -> Any:
    """Run ``mover`` with ``value`` in place of ``source``; None when another argument is a graph value."""
    others = [False]

    def substitute(arg: Node) -> Any:
        if arg is source:
            return value
        others[0] = True
        return arg

    args, kwargs = map_arg(mover.args, substitute), map_arg(mover.kwargs, substitute)
    if others[0]:
        return None
    if mover.op == "call_function":
        return mover.target(*args, **kwargs)
    if mover.op == "call_method":
        return getattr(args[0], str(mover.target))(*args[1:], **kwargs)
    if mover.op == "call_module":
        owner = mover.graph.owning_module
        return None if owner is None else owner.get_submodule(str(mover.target))(*args, **kwargs)
    return None


def keeps_qparam_layout(mover: Node, source: Node, granularity: Granularity) -> bool:
    """True when ``mover`` (reading ``source``) keeps every element under its ``granularity`` qparam.

    False also when the test cannot run: a symbolic or unknown shape, another graph value among the mover's
    arguments (a size computed in the graph), a granularity that does not fit either shape, a tensor above
    ``2**24`` elements, or an op that fails on the index tensor. False is always safe: the mover's output then
    gets a quantizer of its own, laid out for its own shape.
    """
    if get_meta(mover).kind is OpKind.DROPOUT:  # element-wise: zeroes or scales values, never moves them
        return True
    before, after = tensor_info(source), tensor_info(mover)
    if before is None or after is None or -1 in before[0] or -1 in after[0]:
        return False
    if math.prod(before[0]) > _MAX_ELEMENTS:
        return False
    try:
        if granularity.qparam_shape(before[0]) != granularity.qparam_shape(after[0]):
            return False
        expected = _row_index(granularity, after[0])
        with torch.no_grad():
            moved = _run(mover, source, _row_index(granularity, before[0]).clone())
    except (ValueError, RuntimeError, TypeError, IndexError):
        return False
    return isinstance(moved, torch.Tensor) and moved.shape == expected.shape and bool((moved == expected).all())
