r"""Decompose ``scaled_dot_product_attention`` into its matrix products, so that each one can be quantized.

``F.scaled_dot_product_attention`` (FX) and ``aten.scaled_dot_product_attention`` (torch.export) are one opaque
node; left as is, attention runs in float. This pass rewrites every such node into

.. math::

    S = Q K^\top, \qquad P = \mathrm{softmax}(s\,S + M), \qquad O = P V

with :math:`s` the explicit ``scale`` or :math:`1/\sqrt{E}` (:math:`E` = the query's last dimension) and
:math:`M` the mask: a float ``attn_mask`` is added, a bool one (``True`` = attend) and ``is_causal`` (the
upper-left lower-triangular mask, as torch defines it) put :math:`-\infty` where attention is not allowed; both
apply when both are given. A row with every position masked gives zeros, as SDPA does. With ``enable_gqa``
the keys and values are repeated ``H_q / H_kv`` times along the head axis (``repeat_interleave``, dim -3).

What becomes of each part (the op table then gives the quantized edges):

* :math:`Q K^\top` and :math:`P V` are ``torch.matmul`` nodes (``MATMUL``: both operands and the output are
  quantized; onnxruntime runs ``QLinearMatMul``);
* without a mask: ``S * s`` (``MUL``, a constant that ``fold_attention_scale`` moves into the query projection
  when it can) and ``torch.softmax`` (``SOFTMAX``: quantized input, fixed-range output; ``QLinearSoftmax``);
* with a mask: :func:`~coreai_opt.graph.attention_math.masked_softmax` (``SOFTMAX`` whose only quantized
  input is :math:`S`): the scale, the mask and the softmax run in float between the quantized scores and the
  quantized probabilities, because a mask holds :math:`-\infty` (or ``finfo.min``), which no 8-bit grid of the
  scores can represent.

Dropout must be 0 (an eval-mode capture); a non-zero ``dropout_p`` raises ``ValueError``. New nodes inherit the
SDPA node's module scope and stack trace and get shape metadata (``val`` under torch.export, ``tensor_meta``
after FX), so the later passes see them like captured nodes.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from coreai_opt.graph.attention_math import masked_softmax
from coreai_opt.graph.node_meta import get_meta, set_meta
from coreai_opt.graph.pass_result import PassResult

__all__ = ["decompose_attention", "SDPA_TARGETS"]

aten = torch.ops.aten

#: The call targets this pass rewrites (FX and torch.export forms).
SDPA_TARGETS = (torch.nn.functional.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}
# Options the decomposition is specialised on (and attn_mask when it is an input captured as None).
_FLAGS = frozenset({"dropout_p", "is_causal", "scale", "enable_gqa"})


def _constant_input(gm: GraphModule, sdpa: Node, name: str, value: Node) -> object:
    """The captured value of a non-tensor graph input that sets an SDPA option, guarded at run time.

    FX keeps ``forward(x, attn_mask=None, is_causal=False)`` arguments as placeholders; the decomposition is
    specialised on the value they had at capture (their default), and a ``torch._assert`` makes the prepared model
    refuse another value instead of silently ignoring it.
    """
    tensor = isinstance(value.meta.get("val"), torch.Tensor) or value.meta.get("tensor_meta") is not None
    if value.op != "placeholder" or tensor or not value.args:
        raise ValueError(
            f"scaled_dot_product_attention {sdpa.name}: {name} is computed in the graph ({value.format_node()}); "
            f"pass it as a Python constant, or specialise the input with prepare(..., concrete_args={{...}})"
        )
    captured = value.args[0]
    with gm.graph.inserting_before(sdpa):
        same = gm.graph.call_function(operator.is_ if captured is None else operator.eq, (value, captured))
        gm.graph.call_function(torch._assert, (same, f"coreai_opt prepared this model with {value.target}="
                                               f"{captured!r} (its attention was decomposed for that value); "
                                               f"prepare it again to use another value"))
    return captured


def _is_none_input(value: Node) -> bool:
    """An FX placeholder whose captured value was None (an optional mask argument left out)."""
    return value.meta.get("type") is type(None)


def _arguments(gm: GraphModule, node: Node) -> dict[str, Any]:
    values = dict(_DEFAULTS)
    values.update(zip(_POSITIONAL, node.args, strict=False))
    values.update(node.kwargs)
    for name, value in values.items():
        if isinstance(value, Node) and (name in _FLAGS or (name == "attn_mask" and _is_none_input(value))):
            values[name] = _constant_input(gm, node, name, value)
    return values


def _example(value: object) -> object:
    """A tensor standing for ``value`` (its fake value, or a meta tensor of its recorded shape)."""
    if not isinstance(value, Node):
        return value
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val
    tm = value.meta.get("tensor_meta")
    if tm is None:
        raise ValueError(f"decompose_attention needs shape metadata on {value.format_node()}; capture the model first")
    return torch.empty(tuple(tm.shape), dtype=tm.dtype, device="meta")


class _Builder:
    """Inserts nodes before the SDPA node, with its scope, provenance and shape metadata."""

    def __init__(self, gm: GraphModule, sdpa: Node) -> None:
        self.gm, self.sdpa = gm, sdpa
        self.exported = isinstance(sdpa.meta.get("val"), torch.Tensor)
        fakes = [v for v in (a.meta.get("val") for a in sdpa.all_input_nodes) if isinstance(v, torch.Tensor)]
        self.fake_mode = torch._guards.detect_fake_mode(fakes) if self.exported else None

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.gm.graph.inserting_before(self.sdpa):
            node = self.gm.graph.call_function(target, args, kwargs)
        for key in ("nn_module_stack", "stack_trace"):
            if key in self.sdpa.meta:
                node.meta[key] = self.sdpa.meta[key]
        set_meta(node, get_meta(self.sdpa))
        example_args, example_kwargs = map_aggregate((args, kwargs), _example)
        with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext():
            value = target(*example_args, **example_kwargs)
        if self.exported:
            node.meta["val"] = value
        else:
            node.meta["tensor_meta"] = _extract_tensor_metadata(value)
        return node


def _shape(node: Node) -> tuple[Any, ...]:
    return tuple(_example(node).shape)


def _decompose(gm: GraphModule, sdpa: Node) -> None:
    args = _arguments(gm, sdpa)
    label = get_meta(sdpa).module_name or sdpa.name
    dropout = args["dropout_p"]
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise ValueError(
            f"scaled_dot_product_attention in {label} has dropout_p={dropout!r}; quantization needs the "
            "inference graph (dropout 0): call model.eval() before prepare, or pass dropout_p=0.0 outside training"
        )
    query, key, value, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    build = _Builder(gm, sdpa)
    if args["enable_gqa"]:
        heads, kv_heads = _shape(query)[-3], _shape(key)[-3]
        if heads != kv_heads:
            key = build.call(torch.repeat_interleave, key, heads // kv_heads, dim=-3)
            value = build.call(torch.repeat_interleave, value, heads // kv_heads, dim=-3)
    scale = args["scale"]
    scale = 1.0 / math.sqrt(_shape(query)[-1]) if scale is None else float(scale)
    scores = build.call(torch.matmul, query, build.call(torch.transpose, key, -2, -1))
    if mask is None and not args["is_causal"]:
        probs = build.call(torch.softmax, build.call(operator.mul, scores, scale), -1)
    else:
        probs = build.call(masked_softmax, scores, scale, mask, bool(args["is_causal"]))
    out = build.call(torch.matmul, probs, value)
    sdpa.replace_all_uses_with(out)
    gm.graph.erase_node(sdpa)


def decompose_attention(gm: GraphModule) -> PassResult:
    """Rewrite every ``scaled_dot_product_attention`` node (see the module docstring).

    Run it right after capture, before ``classify_ops`` gives the new nodes their kinds.

    Args:
        gm: A captured GraphModule.

    Returns:
        ``PassResult`` counting the rewritten attention calls.

    Raises:
        ValueError: an attention call has a non-zero ``dropout_p`` (the message names the module).
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    for node in nodes:
        _decompose(gm, node)
    return PassResult.after_edits(gm, len(nodes))
