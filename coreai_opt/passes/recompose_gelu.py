r"""Recompose the tanh GELU written as arithmetic into one ``gelu(x, approximate="tanh")``.

.. math::

    \mathrm{gelu}_{\tanh}(x) = \tfrac12\, x \left(1 + \tanh\!\left(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\right)\right)

GPT-2, GPT-Neo, Phi, ALBERT (``NewGELUActivation``: ``0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))``) and
BLOOM (``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))``) write it as seven or eight elementwise
ops. Exported as written, onnxruntime runs each in float (``Pow``, ``Mul``, ``Add``, ``Tanh``, ...), with
``QuantizeLinear`` / ``DequantizeLinear`` pairs wherever an op of the chain asks for its own (the additions:
``QLinearAdd``): 14 kernels per MLP in GPT-Neo, 1.04× ``quantize_static``'s latency. As one GELU (ONNX ``Gelu``,
opset 20) it is one float kernel, ``DQ → Gelu → Q``, and the linear before it writes float (``QGemm``, see
:mod:`coreai_opt.graph.unread_outputs`); fewer roundings, too.

A chain is recognised by value, not by spelling: from each ``tanh``, the elementwise ops (``add``, ``sub``,
``mul``, ``div``, ``pow``, ``tanh``) that compute it from one tensor ``x`` and the ops after it that combine it with
``x`` only, up to the one node the rest of the graph reads. That region is evaluated on a probe of 4,097 points of
``[-8, 8]`` and replaced only when it equals ``F.gelu(probe, approximate="tanh")`` to 1e-5 (float32 rounding of
another order of the same arithmetic; a constant written as 0.05 instead of 0.044715 is off by 2e-3). No
intermediate value of the region may have a reader outside it.

The user's configuration is kept: a chain is recomposed only when ``resolve`` decides every op kind in it and
``gelu`` alike (same specs, same deciding entry). A config naming ``op_kind:tanh`` (or ``mul``, ``add``) for that
module therefore leaves the chain as written. It runs after ``decompose_silu`` and before ``classify_ops``.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import copy_provenance, get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult

if TYPE_CHECKING:  # config imports the passes (level_keys): a type only, no import cycle
    from coreai_opt.config.resolution import Resolver

__all__ = ["recompose_gelu"]

aten = torch.ops.aten


_KINDS = (OpKind.ADD, OpKind.SUB, OpKind.MUL, OpKind.DIV, OpKind.TANH)
_POWS = (torch.pow, operator.pow, aten.pow)
_PROBE = torch.linspace(-8.0, 8.0, 4097)
_TOLERANCE = 1e-5
_MAX_REGION = 16


def _arithmetic(node: Node, gm: GraphModule) -> bool:
    """True for an elementwise ``add`` / ``sub`` / ``mul`` / ``div`` / ``pow`` / ``tanh`` call."""
    if node.op == "call_method":
        return node.target == "pow" or lookup_op(node, gm).kind in _KINDS
    if node.op != "call_function":
        return False
    return getattr(node.target, "overloadpacket", node.target) in _POWS or lookup_op(node, gm).kind in _KINDS


def _inputs(node: Node) -> list[Node]:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, Node)]


def _source_and_cone(tanh: Node, gm: GraphModule) -> tuple[Node, set[Node]] | None:
    """The one tensor ``x`` the tanh's argument is computed from, and the ops between them (module docstring)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    cone, leaves, frontier = {tanh}, set(), _inputs(tanh)
    while frontier:
        frontier.sort(key=position.__getitem__)
        node = frontier.pop()  # the latest first: every reader inside the cone is in it by then
        if node in cone or node in leaves:
            continue
        if _arithmetic(node, gm) and all(u in cone for u in node.users) and len(cone) < _MAX_REGION:
            cone.add(node)
            frontier.extend(_inputs(node))
        else:
            leaves.add(node)
    return (leaves.pop(), cone) if len(leaves) == 1 else None


def _candidates(tanh: Node, gm: GraphModule) -> list[tuple[Node, list[Node]]]:
    """``(x, region)`` pairs that may compute ``gelu(x)``, one per op after the tanh.

    Each op after the tanh that combines it with ``x`` only, with its ancestors back to ``x`` in graph order (the op
    last), when none of them but the op is read from outside.
    """
    found = _source_and_cone(tanh, gm)
    if found is None:
        return []
    x, region = found
    nodes = list(gm.graph.nodes)
    for node in nodes[nodes.index(x) + 1:]:  # the ops after tanh that combine it with x only (0.5·x, 1 + tanh, ...)
        if len(region) >= _MAX_REGION:
            break
        if node not in region and _arithmetic(node, gm) and _inputs(node) \
                and all(a is x or a in region for a in _inputs(node)):
            region.add(node)
    ordered = [n for n in nodes if n in region]
    downstream, candidates = {tanh}, []
    for output in ordered:
        if output is not tanh and not any(a in downstream for a in _inputs(output)):
            continue
        downstream.add(output)
        needed, stack = set(), [output]
        while stack:  # the output's ancestors inside the region
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(a for a in _inputs(node) if a in region)
        chain = [n for n in ordered if n in needed]
        if all(u in needed for n in chain[:-1] for u in n.users):
            candidates.append((x, chain))
    return candidates


def _evaluate(x: Node, region: list[Node], probe: torch.Tensor) -> torch.Tensor:
    """The region's value with ``probe`` in place of ``x`` (every op is elementwise: scalars broadcast)."""
    values: dict[Node, torch.Tensor] = {x: probe}

    def value(a: object) -> object:
        return values[a] if isinstance(a, Node) else a

    for node in region:
        args = [value(a) for a in node.args]
        kwargs = {k: value(v) for k, v in node.kwargs.items()}
        if node.op == "call_method":
            values[node] = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    return values[region[-1]]


def _is_tanh_gelu(x: Node, region: list[Node]) -> bool:
    example = x.meta.get("val")
    if example is not None and getattr(example, "dtype", torch.float32) != torch.float32:
        return False
    try:
        with torch.no_grad():
            got = _evaluate(x, region, _PROBE.clone())
    except (TypeError, RuntimeError, KeyError):
        return False
    expected = nn.functional.gelu(_PROBE, approximate="tanh")
    return isinstance(got, torch.Tensor) and got.shape == expected.shape \
        and bool((got - expected).abs().max() <= _TOLERANCE)


def _keeps_config(resolve: Resolver, gm: GraphModule, region: list[Node]) -> bool:
    """True when every op kind of the region resolves as ``gelu`` does (same specs, same deciding entry)."""
    meta = get_meta(region[-1])
    gelu = resolve(OpKind.GELU.value, meta.module_name, meta.module_type)
    kinds = {lookup_op(n, gm).kind for n in region} - {OpKind.OTHER}  # pow has no kind: nothing configures it
    return all(resolve(kind.value, get_meta(n).module_name, get_meta(n).module_type) == gelu
               for kind in kinds for n in region if lookup_op(n, gm).kind is kind)


def recompose_gelu(gm: GraphModule, resolve: Resolver) -> PassResult:
    """Replace every tanh-GELU chain of elementwise ops with one ``gelu(x, approximate="tanh")`` (module docstring).

    Args:
        gm: A captured GraphModule (after ``functionalize_inplace``, before ``classify_ops``).
        resolve: ``QuantizerConfig.resolve`` of the config being prepared.

    Returns:
        ``PassResult`` counting the chains replaced.
    """
    changes, erased = 0, set()
    for tanh in [n for n in gm.graph.nodes if _arithmetic(n, gm) and lookup_op(n, gm).kind is OpKind.TANH]:
        if tanh in erased:  # part of an earlier chain
            continue
        found = next((c for c in _candidates(tanh, gm) if _is_tanh_gelu(*c)), None)
        if found is None or not _keeps_config(resolve, gm, found[1]):
            continue
        x, region = found
        output = region[-1]
        aten_graph = isinstance(tanh.target, torch._ops.OpOverload)
        with gm.graph.inserting_before(output):
            gelu = gm.graph.call_function(aten.gelu.default if aten_graph else nn.functional.gelu, (x,),
                                          {"approximate": "tanh"})
        copy_provenance(output, gelu)
        set_meta(gelu, replace(get_meta(output), kind=None))
        output.replace_all_uses_with(gelu)
        for node in reversed(region):
            gm.graph.erase_node(node)
        erased.update(region)
        changes += 1
    if changes:
        gm.recompile()
    return PassResult(gm, changes)
