r"""SmoothQuant graph transformation: move activation outliers into the weights of the linears that read them.

For a tensor ``X`` read by linears ``y_i = X W_iᵀ + b_i`` and a per-input-channel scale ``s`` (> 0)::

    X' = X / s          W_i' = W_i · diag(s)          ⇒   X' W_i'ᵀ = X W_iᵀ   (exact in real arithmetic)

with ``s_j = max|X_j|^α / max_i max|W_i[:, j]|^(1−α)`` (computed by :mod:`coreai_opt.api.algorithms.smooth_quant`).
Multiplying the weights is free. Dividing ``X`` is free only when it can be folded into ``X``'s producer; this
pass finds, for every linear input tensor, a *site* and classifies it:

=====================  ==============================================================================
site kind              how ``X / s`` is applied
=====================  ==============================================================================
``layer_norm``         LayerNorm whose output feeds only linears: ``γ /= s``, ``β /= s``
``linear``             linear whose output feeds only linears: its rows ``W_p[j, :] /= s_j``, ``b_p /= s``
``attention_value``    ``X`` = attention output fed only by the value projection ``V`` through value-moving
                       ops (view / transpose / reshape) and the probabilities-times-value product
                       (``scaled_dot_product_attention`` value or ``matmul`` right operand): attention is
                       linear in ``V`` channel by channel, so ``V``'s rows and bias are divided
``mul`` (not foldable) ``X`` also feeds something else (a residual add in post-LN BERT) or comes from a
                       non-linear op (GELU): folding is impossible; with ``insert_mul=True`` a constant
                       ``X · (1/s)`` node is inserted on the path to the linears only (one elementwise op)
=====================  ==============================================================================

The pass works on a captured GraphModule (``torch.export`` or FX) whose weights are ``get_attr`` nodes; it
edits those parameters in place. :func:`find_sites` only reads the graph, :func:`apply_smoothing` edits it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from coreai_opt.graph.graph_attrs import attr_value
from coreai_opt.graph.linear_readers import linear_bias, linear_readers, linear_weight
from coreai_opt.graph.pass_result import PassResult

__all__ = ["SmoothingSite", "apply_smoothing", "find_sites", "FOLDABLE_KINDS"]

aten = torch.ops.aten
_LAYER_NORM = {aten.layer_norm.default}
_MOVES = {aten.view.default, aten.reshape.default, aten.transpose.int, aten._unsafe_view.default,
          aten.contiguous.default, aten.clone.default, aten.dropout.default, aten.permute.default,
          aten.alias.default}
_SDPA = {aten.scaled_dot_product_attention.default}
_MATMUL = {aten.matmul.default, aten.bmm.default}
#: Site kinds whose scale folds into existing parameters (no new op).
FOLDABLE_KINDS = frozenset({"layer_norm", "linear", "attention_value"})


@dataclass(frozen=True)
class SmoothingSite:
    """One linear input tensor ``X`` and how a smoothing scale would be applied to it.

    Attributes:
        tensor: Name of the graph node producing ``X``.
        consumers: ``get_attr`` targets of the weights of the linears reading ``X`` (``"...query.weight"``).
        kind: ``"layer_norm"``, ``"linear"``, ``"attention_value"`` (foldable) or ``"mul"``.
        producer: ``get_attr`` targets of the parameters divided by ``s`` (foldable kinds), else ``()``.
        reason: For ``"mul"``: why folding is impossible.
    """

    tensor: str
    consumers: tuple[str, ...]
    kind: str
    producer: tuple[str, ...] = ()
    reason: str = ""

    @property
    def foldable(self) -> bool:
        """True when the scale folds into existing parameters."""
        return self.kind in FOLDABLE_KINDS


def _attr_target(node: object) -> str | None:
    return str(node.target) if isinstance(node, Node) and node.op == "get_attr" else None


def _is(node: Node, targets: set) -> bool:
    return node.op == "call_function" and node.target in targets


def _weight_target(node: Node, gm: GraphModule) -> str | None:
    return _attr_target(linear_weight(node, gm))


def _bias_target(node: Node, gm: GraphModule) -> str | None:
    return _attr_target(linear_bias(node, gm))


def _single_user_chain_back(node: Node) -> Node:
    """Walk from ``node`` back through single-user value-moving ops; return the first other node."""
    while _is(node, _MOVES) and isinstance(node.args[0], Node) and len(node.args[0].users) == 1:
        node = node.args[0]
    return node


def _attention_value_producer(x: Node, gm: GraphModule) -> Node | None:
    """The value-projection linear whose output reaches ``x`` only through moves and P @ V, else None."""
    node = _single_user_chain_back(x)
    if node is x and not (_is(x, _SDPA) or _is(x, _MATMUL)):
        return None
    if _is(node, _SDPA):
        value = node.args[2] if len(node.args) > 2 else None
    elif _is(node, _MATMUL):
        value = node.args[1]
    else:
        return None
    if not isinstance(value, Node) or len(node.users) != 1 or len(value.users) != 1:
        return None
    source = _single_user_chain_back(value)
    if _weight_target(source, gm) is None or len(source.users) != 1:
        return None
    return source


def _classify(x: Node, readers: list[Node], gm: GraphModule) -> SmoothingSite:
    consumers = tuple(_weight_target(r, gm) for r in readers)
    only_linears = len(readers) == len(x.users)
    if _is(x, _LAYER_NORM) and only_linears:
        gamma = _attr_target(x.args[2]) if len(x.args) > 2 else None
        beta = _attr_target(x.args[3]) if len(x.args) > 3 else None
        if gamma is not None:
            return SmoothingSite(x.name, consumers, "layer_norm", tuple(t for t in (gamma, beta) if t))
        return SmoothingSite(x.name, consumers, "mul", reason="LayerNorm without an affine weight")
    if _weight_target(x, gm) is not None and only_linears:
        params = tuple(t for t in (_weight_target(x, gm), _bias_target(x, gm)) if t)
        return SmoothingSite(x.name, consumers, "linear", params)
    if only_linears:
        value = _attention_value_producer(x, gm)
        if value is not None:
            params = tuple(t for t in (_weight_target(value, gm), _bias_target(value, gm)) if t)
            return SmoothingSite(x.name, consumers, "attention_value", params)
    others = [u.name for u in x.users if u not in readers]
    if others:
        reason = f"'{x.name}' also feeds {', '.join(others)} (not a linear), so it cannot be divided at its source"
    else:
        reason = f"'{x.name}' is produced by a non-linear op ({x.target}), which a channel scale does not commute with"
    return SmoothingSite(x.name, consumers, "mul", reason=reason)


def find_sites(gm: GraphModule) -> list[SmoothingSite]:
    """Classify every tensor read by at least one linear with a ``get_attr`` weight (graph order)."""
    sites = []
    for node in gm.graph.nodes:
        readers = linear_readers(node, gm)
        if readers:
            sites.append(_classify(node, readers, gm))
    return sites


def _scale_rows(t: Tensor, inv: Tensor) -> None:
    shape = [-1] + [1] * (t.dim() - 1)
    t.mul_(inv.reshape(shape).to(t.dtype))


def apply_smoothing(gm: GraphModule, sites: list[SmoothingSite], scales: Mapping[str, Tensor], *,
                    insert_mul: bool = False) -> PassResult:
    """Apply ``X' = X / s``, ``W' = W·diag(s)`` at each site with a scale in ``scales`` (keyed by site tensor).

    Foldable sites edit parameters in place. ``"mul"`` sites are skipped unless ``insert_mul``; then a buffer
    ``_smooth_inv_scale_<k>`` holding ``1/s`` and a node ``mul(X, 1/s)`` feeding the site's linears are added.

    Returns:
        ``PassResult`` counting smoothed sites.

    Raises:
        ValueError: a scale has the wrong length or is not strictly positive and finite.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    changes = 0
    with torch.no_grad():
        for site in sites:
            s = scales.get(site.tensor)
            if s is None or (not site.foldable and not insert_mul):
                continue
            weights = [attr_value(gm, t) for t in site.consumers]
            if s.dim() != 1 or s.numel() != weights[0].shape[1] or not bool(torch.isfinite(s).all() & (s > 0).all()):
                raise ValueError(
                    f"smoothing scale for '{site.tensor}' must be positive, finite and of length "
                    f"{weights[0].shape[1]} (input channels), got shape {tuple(s.shape)}"
                )
            for w in {id(w): w for w in weights}.values():
                w.mul_(s.to(w.dtype).reshape(1, -1))
            inv = 1.0 / s
            if site.foldable:
                for target in site.producer:
                    _scale_rows(attr_value(gm, target), inv)
            else:
                x = by_name[site.tensor]
                name = f"_smooth_inv_scale_{changes}"
                while hasattr(gm, name):
                    name += "_"
                gm.register_buffer(name, inv.to(torch.float32).clone())
                readers = [u for u in linear_readers(x, gm) if _weight_target(u, gm) in site.consumers]
                with gm.graph.inserting_after(x):
                    const = gm.graph.get_attr(name)
                with gm.graph.inserting_after(const):
                    mul = gm.graph.call_function(aten.mul.Tensor, (x, const))
                for r in readers:
                    r.replace_input_with(x, mul)
            changes += 1
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changes)
