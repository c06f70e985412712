r"""Break the ties of ``sort``, ``argsort`` and ``topk`` by index, as onnxruntime's ``TopK`` does.

Equal values have no defined order in ``torch.sort`` (``stable=False``) or ``torch.topk``, and torch's CPU kernels do
not keep the input order: on 32 expert ids in 0..7, ``torch.sort`` permutes the equal ones differently from a stable
sort. torch's exporter writes all three as ONNX ``TopK``, and onnxruntime's ``TopK`` orders equal values by index
(measured: it matches ``torch.sort(stable=True)`` on every case tried, ascending and descending). So a model whose
later ops read the sorted order diverged between eager and onnxruntime with no defect on either side:

* a mixture-of-experts layer (transformers' ``grouped_mm`` experts) sorts its routed rows by expert id; the
  gathered rows, in eager's order and onnxruntime's, are two permutations of the same tensor (verify compared
  them position by position and failed a correct file);
* ``topk`` over quantized values (a router's probabilities after an 8-bit quantizer) ties often, and which tied
  expert is chosen changes the output.

The pass rewrites every such node to a function with onnxruntime's order, the index order of a stable sort:

.. math::

    \mathrm{topk}(x, k) = \mathrm{sort}_{\mathrm{stable}}(x)[:k]

a valid result of the original op (any order of equal values is), so the model computes what it computed before,
now deterministically and as onnxruntime does. The export traces the functions into ``aten.sort.stable`` (ONNX
``TopK``) and a slice. It runs on the captured graph before ``classify_ops`` (the ops stay ``OpKind.OTHER``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from coreai_opt.graph.pass_result import PassResult

__all__ = ["order_ties", "stable_argsort", "stable_sort", "stable_topk"]

aten = torch.ops.aten


def stable_sort(x: Tensor, dim: int = -1, descending: bool = False) -> Any:
    """``torch.sort`` with equal values in index order (``stable=True``); returns ``torch.return_types.sort``."""
    return torch.sort(x, dim=dim, descending=descending, stable=True)


def stable_argsort(x: Tensor, dim: int = -1, descending: bool = False) -> Tensor:
    """``torch.argsort`` with equal values in index order."""
    return torch.sort(x, dim=dim, descending=descending, stable=True).indices


def stable_topk(x: Tensor, k: int, dim: int = -1, largest: bool = True) -> Any:
    """``torch.topk(x, k, dim, largest, sorted=True)`` choosing and ordering equal values by index, as ``TopK``.

    Returns ``torch.return_types.topk`` (``.values``, ``.indices``), so the node's readers are unchanged.
    """
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


#: (replacement, names of its parameters after the tensor, their defaults).
_Rewrite = tuple[Callable[..., Any], tuple[str, ...], tuple[Any, ...]]
_SORT: _Rewrite = (stable_sort, ("dim", "descending"), (-1, False))
_ARGSORT: _Rewrite = (stable_argsort, ("dim", "descending"), (-1, False))
_TOPK: _Rewrite = (stable_topk, ("k", "dim", "largest"), (None, -1, True))

_BY_FUNCTION: dict[Any, _Rewrite] = {
    torch.sort: _SORT, aten.sort.default: _SORT, aten.sort.stable: _SORT,
    torch.argsort: _ARGSORT, aten.argsort.default: _ARGSORT, aten.argsort.stable: _ARGSORT,
    torch.topk: _TOPK, aten.topk.default: _TOPK,
}
_BY_METHOD: dict[str, _Rewrite] = {"sort": _SORT, "argsort": _ARGSORT, "topk": _TOPK}


def _rewrite_of(node: Node) -> _Rewrite | None:
    if node.op == "call_method":
        return _BY_METHOD.get(str(node.target))
    if node.op == "call_function":
        try:
            return _BY_FUNCTION.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


def _arguments(node: Node, names: tuple[str, ...], defaults: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The node's tensor and its arguments by name (positional after the tensor, or keywords); None if unknown."""
    x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    values = []
    for position, (name, default) in enumerate(zip(names, defaults, strict=True), start=1):
        value = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
        values.append(value)
    known = set(names) | {"input", "self", "stable", "sorted"}
    if x is None or any(v is None for v in values) or set(node.kwargs) - known:
        return None  # e.g. an out= argument: leave the node as it is
    return (x, *values)


def order_ties(gm: GraphModule) -> PassResult:
    """Rewrite each ``sort`` / ``argsort`` / ``topk`` node to its stable function (``stable_sort``, ...).

    Args:
        gm: A captured GraphModule (FX or ``torch.export`` form), before ``classify_ops``.

    Returns:
        ``PassResult`` counting the nodes rewritten.

    Example:
        >>> from coreai_opt.passes.capture import capture
        >>> class Route(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.topk(x, 2).indices
        >>> gm = capture(Route(), (torch.tensor([[1.0, 3.0, 3.0, 3.0]]),))
        >>> order_ties(gm).changes, gm(torch.tensor([[1.0, 3.0, 3.0, 3.0]])).tolist()
        (1, [[1, 2]])
    """
    changes = 0
    for node in list(gm.graph.nodes):
        rewrite = _rewrite_of(node)
        arguments = _arguments(node, rewrite[1], rewrite[2]) if rewrite is not None else None
        if rewrite is None or arguments is None:
            continue
        node.op, node.target, node.args, node.kwargs = "call_function", rewrite[0], arguments, {}
        changes += 1
    return PassResult.after_edits(gm, changes)
