r"""Decompose SiLU into ``x · sigmoid(x)``, so that onnxruntime runs it as ``QLinearSigmoid → QLinearMul``.

.. math::

    \mathrm{silu}(x) = x \cdot \sigma(x), \qquad \sigma(x) = \frac{1}{1 + e^{-x}}

Kept as one node, a SiLU gets a quantizer on its input and output only; ONNX has no SiLU op, so the exported
graph is ``DQ → Sigmoid → Mul → Q`` and onnxruntime runs both ops in float, with a full-size float tensor in
and out of each (measured on timm's efficientnet-b0, 49 SiLUs: 1.13–1.19× ``quantize_static``'s latency, 1 thread,
batch 1, interleaved rounds). Split into ``torch.sigmoid`` and ``torch.mul``, the op table quantizes the sigmoid's
output (``SIGMOID``: input and output) and the product (``MUL``: both operands and the output), the placement of
onnxruntime's ``quantize_static``: ``QLinearSigmoid`` (a 256-entry table) then ``QLinearMul``, integer end to end.

A SiLU is split only where the split keeps the user's configuration: the new ``sigmoid`` and ``mul`` nodes keep
the SiLU's module name and type, and the split happens only when ``resolve`` gives the op kinds ``sigmoid`` and
``mul`` the same weight and activation specs it gives ``silu`` there. A config that names ``op_kind:silu`` (e.g.
``None`` to keep SiLU float, or another dtype) therefore leaves that SiLU whole, as before. A SiLU whose
activations stay float (weight-only presets) is left whole too: splitting it would change nothing but names.

Only SiLUs on 4-D feature maps (``[N, C, H, W]``: EfficientNet, MobileViT) are split for now. On a decoder's
MLP (3-D ``[batch, sequence, hidden]``) the split was measured to break the token identity of greedy generation
between onnxruntime and eager on the test Llama (w8a8, first difference at token 36 of the KV-cache export test):
``QLinearSigmoid``'s table and torch's sigmoid round some values to neighbouring codes. Until that is understood,
3-D SiLUs (decoders, 1-D conv stacks) keep their float ``Sigmoid → Mul``.

Targets: ``nn.SiLU`` modules (exactly that class), ``F.silu`` and ``aten.silu`` (FX and torch.export forms). It
runs after ``functionalize_inplace`` (every SiLU is out of place by then) and before ``classify_ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import copy_provenance, get_meta, set_meta, tensor_info
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.pass_result import PassResult

if TYPE_CHECKING:  # config imports the passes (level_keys): a type only, no import cycle
    from coreai_opt.config.resolution import Resolver

__all__ = ["SILU_FUNCTIONS", "decompose_silu"]

aten = torch.ops.aten

#: The ``call_function`` targets this pass splits (FX and torch.export forms).
SILU_FUNCTIONS = (torch.nn.functional.silu, aten.silu.default, aten.silu)



def _is_silu(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in SILU_FUNCTIONS
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))) is nn.SiLU
    return False


def _input(node: Node) -> Node | None:
    value = node.args[0] if node.args else node.kwargs.get("input")
    return value if isinstance(value, Node) else None


def _feature_map(node: Node) -> bool:
    """True when the SiLU's output is a 4-D tensor (a conv feature map, ``[N, C, H, W]``)."""
    info = tensor_info(node)
    return info is not None and len(info[0]) == 4


def _split_keeps_config(resolve: Resolver, node: Node) -> bool:
    """True when the silu's activations are quantized and ``sigmoid`` / ``mul`` resolve to the silu's specs."""
    meta = get_meta(node)

    def specs(kind: OpKind) -> tuple[object, object]:
        resolved = resolve(kind.value, meta.module_name, meta.module_type)
        return resolved.weight, resolved.activation  # type: ignore[attr-defined]

    silu = specs(OpKind.SILU)
    return silu[1] is not None and specs(OpKind.SIGMOID) == silu and specs(OpKind.MUL) == silu


def _call(gm: GraphModule, silu: Node, target: Callable[..., torch.Tensor], args: tuple[object, ...]) -> Node:
    with gm.graph.inserting_before(silu):
        node = gm.graph.call_function(target, args)
    copy_provenance(silu, node)  # sigmoid and mul: silu's shape, dtype, module and source line
    set_meta(node, replace(get_meta(silu), kind=None))
    return node


def decompose_silu(gm: GraphModule, resolve: Resolver) -> PassResult:
    """Rewrite every SiLU into ``torch.mul(x, torch.sigmoid(x))`` where the config allows (module docstring).

    Args:
        gm: A captured GraphModule (after ``functionalize_inplace``, before ``classify_ops``).
        resolve: ``QuantizerConfig.resolve`` of the config being prepared.

    Returns:
        ``PassResult`` counting the SiLUs split.

    Example:
        >>> import coreai_opt as co
        >>> from coreai_opt.passes.capture import capture
        >>> gm = capture(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.SiLU()), (torch.randn(1, 1, 2, 2),))
        >>> decompose_silu(gm, co.QuantizerConfig.presets.w8a8().resolve).changes
        1
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-2:]
        [<built-in method sigmoid of type object at ...>, <built-in method mul of type object at ...>]
    """
    changes = 0
    for node in list(gm.graph.nodes):
        x = _input(node) if _is_silu(node, gm) else None
        if x is None or not _feature_map(node) or not _split_keeps_config(resolve, node):
            continue
        gate = _call(gm, node, torch.sigmoid, (x,))
        product = _call(gm, node, torch.mul, (x, gate))
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        changes += 1
    if changes:
        gm.recompile()
    return PassResult(gm, changes)
