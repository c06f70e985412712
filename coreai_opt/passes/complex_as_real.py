r"""Carry complex tensors as real pairs, so a model with complex arithmetic (rotary embeddings) exports to ONNX.

ONNX has no complex element type for these ops and torch's exporter translates no op on a complex tensor: rotary
position embeddings written with complex numbers (``torch.polar`` for the table, ``view_as_complex`` on the query
and key, a complex product, ``view_as_real`` back; transformers' DeepSeek-V2 and Llama 4) stop the export at the
first ``unsqueeze`` of the complex table, in torch's own float export too.

Here every complex tensor :math:`z` of shape :math:`S` is carried as the real tensor :math:`r` of shape
:math:`(S, 2)` that ``torch.view_as_real(z)`` is (real part, imaginary part last), and each op on it is rewritten:

.. math::

    \mathrm{polar}(\rho, \theta) &= (\rho\cos\theta,\ \rho\sin\theta) \\
    (a + bi)(c + di) &= (ac - bd,\ ad + bc) \\
    \mathrm{view\_as\_complex}(x) &= x, \qquad \mathrm{view\_as\_real}(r) = r

Shape ops (``unsqueeze``, ``slice``, ``select``, ``transpose``, ``view`` / ``reshape`` / ``expand``, copies) act on
the leading dimensions: a negative dimension moves one place left, a target shape gains the trailing 2. The
products are float32 elementwise operations: the same values as torch's complex kernel up to float32 rounding.

The pass is all or nothing: when a complex tensor meets an op outside this list it leaves the graph as it is (the
export then names that op and its source line). It runs on the captured graph first, before every other pass.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from coreai_opt.graph.pass_result import PassResult

__all__ = ["complex_as_real", "complex_mul", "polar_as_real", "to_complex_pair"]

aten = torch.ops.aten


def polar_as_real(magnitude: Tensor, angle: Tensor) -> Tensor:
    """``torch.view_as_real(torch.polar(magnitude, angle))``: ``(ρ cos θ, ρ sin θ)`` on a trailing axis."""
    return torch.stack((magnitude * torch.cos(angle), magnitude * torch.sin(angle)), dim=-1)


def to_complex_pair(real: Tensor, imaginary: Tensor) -> Tensor:
    """``torch.view_as_real(torch.complex(real, imaginary))``."""
    return torch.stack((real, imaginary), dim=-1)


def complex_mul(a: Any, b: Any, a_complex: bool, b_complex: bool) -> Tensor:
    """The product of two operands, each a real pair (``*_complex``) or a real tensor / number.

    ``(a + bi)(c + di) = (ac − bd, ad + bc)``; a real factor scales both parts.
    """
    if a_complex and b_complex:
        ar, ai, br, bi = a[..., 0], a[..., 1], b[..., 0], b[..., 1]
        return torch.stack((ar * br - ai * bi, ar * bi + ai * br), dim=-1)
    pair, factor = (a, b) if a_complex else (b, a)
    return pair * (factor.unsqueeze(-1) if isinstance(factor, Tensor) else factor)


def _is_complex(value: Any) -> bool:
    meta = value.meta.get("tensor_meta") if isinstance(value, Node) else None
    val = value.meta.get("val") if isinstance(value, Node) else None
    dtype = getattr(meta, "dtype", None) or getattr(val, "dtype", None)
    return dtype is not None and dtype.is_complex


def _rank(node: Node) -> int:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None) or getattr(node.meta.get("val"), "shape", None)
    return len(shape)


def _dim(dim: int) -> int:
    """A dimension of a complex tensor, on its real pair (one more dimension, trailing)."""
    return dim - 1 if dim < 0 else dim


#: Ops whose complex result is their complex input moved by a dimension argument (index into node.args).
_DIM_ARG: dict[Any, tuple[int, ...]] = {
    aten.unsqueeze.default: (1,), aten.slice.Tensor: (1,), aten.select.int: (1,), aten.transpose.int: (1, 2),
    aten.cat.default: (1,), aten.squeeze.dim: (1,),
}
#: Ops whose second argument is a target shape (gains the trailing 2).
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
#: Ops that copy or move their input unchanged in shape.
_SAME = {aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
         aten._to_copy.default, aten.to.device, aten.lift_fresh_copy.default}
_MUL = {aten.mul.Tensor, aten.mul.Scalar, operator.mul, torch.mul}
_ADD = {aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, operator.add: torch.add, operator.sub: torch.sub}
_IDENTITY = {aten.view_as_complex.default, torch.view_as_complex, aten.view_as_real.default, torch.view_as_real}
_PARTS = {aten.real.default: 0, torch.real: 0, aten.imag.default: 1, torch.imag: 1}
_ASSERT = aten._assert_tensor_metadata.default
#: FX's method calls on a complex tensor: dimension arguments, shape-taking methods, unchanged-shape methods.
_METHOD_DIM_ARG = {"unsqueeze": (1,), "transpose": (1, 2), "squeeze": (1,), "select": (1,), "narrow": (1,)}
_METHOD_SHAPE = {"view", "reshape", "expand"}
_METHOD_SAME = {"contiguous", "clone", "detach"}


def _method_rewrite(node: Node) -> Callable[[], None] | None:
    """The edit for an FX ``call_method`` on a complex tensor (``x.unsqueeze(1)``, ``x * y`` is a function)."""
    name, args = str(node.target), node.args
    if node.kwargs or not _is_complex(args[0]):
        return None
    if name == "mul" and len(args) == 2:
        flags = (True, _is_complex(args[1]))
        return lambda: (setattr(node, "op", "call_function"), _retarget(node, complex_mul, flags))
    if name in _METHOD_SAME:
        return lambda: None
    if name in _METHOD_DIM_ARG and all(len(args) > i and isinstance(args[i], int) for i in _METHOD_DIM_ARG[name]):
        return lambda: _retarget(node, name, change={i: _dim(args[i]) for i in _METHOD_DIM_ARG[name]})
    if name == "flatten" and len(args) <= 3 and all(isinstance(a, int) for a in args[1:]):
        start, end = (*args[1:], 0, -1)[:2] if len(args) == 1 else (args[1], args[2] if len(args) == 3 else -1)
        return lambda: setattr(node, "args", (node.args[0], _dim(start), _dim(end)))
    if name in _METHOD_SHAPE and len(args) == 2 and isinstance(args[1], (list, tuple)):
        return lambda: _retarget(node, name, change={1: [*args[1], 2]})
    if name in _METHOD_SHAPE and len(args) > 1 and not any(isinstance(a, (list, tuple)) for a in args[1:]):
        return lambda: _retarget(node, name, (2,))
    return None


def _index_rewrite(node: Node) -> Callable[[], None] | None:
    """``z[index]``: the leading dimensions are indexed alike; an ``...`` gains a trailing ``:`` (the pair axis)."""
    index = node.args[1]
    if isinstance(index, tuple) and Ellipsis in index:
        return lambda: _retarget(node, operator.getitem, change={1: (*index, slice(None))})
    if index is Ellipsis:
        return lambda: None
    parts = index if isinstance(index, tuple) else (index,)
    known = all(p is None or isinstance(p, (int, slice, Node)) for p in parts)
    return (lambda: None) if known else None


def _retarget(node: Node, target: Any, extra: tuple[Any, ...] = (), change: dict[int, Any] | None = None) -> None:
    """Point ``node`` at ``target`` with its current arguments (read now: an earlier edit may have moved them)."""
    args = [(change or {}).get(i, a) for i, a in enumerate(node.args)]
    node.target, node.args = target, (*args, *extra)


def _rewrite(node: Node) -> Callable[[], None] | None:
    """The edit that moves ``node`` onto real pairs, or None when it cannot be rewritten."""
    target, args = node.target, node.args
    if node.op == "call_method":
        return _method_rewrite(node)
    if node.op != "call_function":
        return None  # a complex input, output or module call: not rewritten
    if target is operator.getitem and _is_complex(args[0]):
        return _index_rewrite(node)
    if target is _ASSERT:
        return lambda: node.graph.erase_node(node)
    if target in _IDENTITY:
        return lambda: (node.replace_all_uses_with(node.args[0]), node.graph.erase_node(node))
    if target in (aten.polar.default, torch.polar):
        return lambda: _retarget(node, polar_as_real)
    if target in (aten.complex.default, torch.complex):
        return lambda: _retarget(node, to_complex_pair)
    if target in _PARTS:
        return lambda: _retarget(node, aten.select.int, (-1, _PARTS[target]))
    if target in _MUL and len(args) == 2 and not node.kwargs:
        flags = (_is_complex(args[0]), _is_complex(args[1]))
        return lambda: _retarget(node, complex_mul, flags)
    if target in _ADD and len(args) == 2 and not node.kwargs and all(_is_complex(a) for a in args):
        return lambda: _retarget(node, _ADD[target])
    first = args[0][0] if target is aten.cat.default else args[0]
    if not _is_complex(first):
        return None
    if target in _SAME:  # a copy or move; one that also casts (to complex128, to float) is not known here
        casts = any(isinstance(a, torch.dtype) for a in [*args[1:], *node.kwargs.values()])
        return None if casts else (lambda: None)
    if target in _DIM_ARG and all(len(args) > i and isinstance(args[i], int) for i in _DIM_ARG[target]):
        return lambda: _retarget(node, target, change={i: _dim(args[i]) for i in _DIM_ARG[target]})
    if target in _SHAPE_ARG and isinstance(args[1], (list, tuple)):
        return lambda: _retarget(node, target, change={1: [*args[1], 2]})
    if target is aten.permute.default:
        rank = _rank(first)
        return lambda: _retarget(node, target, change={1: [d % rank for d in args[1]] + [rank]})
    return None


def complex_as_real(gm: GraphModule) -> PassResult:
    """Rewrite every op on a complex tensor onto real pairs (module docstring), or change nothing.

    Args:
        gm: A captured GraphModule with ``tensor_meta`` or ``val`` on its nodes.

    Returns:
        ``PassResult`` counting the nodes rewritten (0 when the graph has no complex tensor or an op the pass does
        not know touches one).

    Example:
        >>> from coreai_opt.passes.capture import capture
        >>> class Rotate(torch.nn.Module):
        ...     def forward(self, x, angle):
        ...         z = torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.polar(torch.ones_like(angle), angle)
        ...         return torch.view_as_real(z).flatten(1)
        >>> x, angle = torch.tensor([[1.0, 0.0, 0.0, 1.0]]), torch.tensor([torch.pi / 2, 0.0])
        >>> gm = capture(Rotate(), (x, angle), method="export")
        >>> complex_as_real(gm).changes > 0, (gm(x, angle).round(decimals=5) + 0.0).tolist()
        (True, [[0.0, 1.0, 0.0, 1.0]])
    """
    touched = [n for n in gm.graph.nodes if _is_complex(n) or any(_is_complex(a) for a in n.all_input_nodes)]
    edits = [_rewrite(node) for node in touched]
    if not touched or any(edit is None for edit in edits):
        return PassResult.after_edits(gm, 0)
    for node in touched:  # the metadata of a complex result: its real pair, float32 (read by later passes)
        meta = node.meta.get("tensor_meta")
        if _is_complex(node) and isinstance(meta, TensorMetadata):
            real = meta.dtype.to_real()
            node.meta["tensor_meta"] = meta._replace(shape=torch.Size([*meta.shape, 2]), dtype=real, stride=None)
        if _is_complex(node) and isinstance(node.meta.get("val"), Tensor):
            node.meta["val"] = torch.view_as_real(node.meta["val"])
    for edit in edits:
        edit()  # type: ignore[misc]
    return PassResult.after_edits(gm, len(touched))
