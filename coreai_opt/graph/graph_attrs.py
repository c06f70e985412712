"""Reading and rebinding the attributes a graph's ``get_attr`` nodes name (``"layer1.0.conv1.weight"``).

One place splits a qualified target into its owner module and attribute name, so that every pass and API
module reads weights, buffers and quantizer modules the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import tensor_info

__all__ = ["attr_value", "bind_parameter", "exclusive_tensor", "get_attr_value", "node_shape",
           "rescale_weight_and_bias", "split_target"]


def split_target(target: object) -> tuple[str, str]:
    """``"a.b.weight"`` -> ``("a.b", "weight")``; a top-level attribute has the owner ``""`` (the root)."""
    owner, _, name = str(target).rpartition(".")
    return owner, name


def attr_value(root: nn.Module, target: object) -> Any:
    """The object at the qualified ``target`` of ``root`` (a parameter, buffer, module or plain attribute).

    Raises:
        AttributeError: ``target`` does not exist (the message names it).
    """
    owner, name = split_target(target)
    return getattr(root.get_submodule(owner), name)


def get_attr_value(node: object, root: nn.Module) -> Any | None:
    """The object a ``get_attr`` node reads; None for any other node or value, or a missing attribute."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    try:
        return attr_value(root, node.target)
    except AttributeError:
        return None


def node_shape(node: Node, gm: GraphModule) -> tuple[int, ...] | None:
    """Shape of the tensor a node produces (a ``get_attr`` tensor or a traced output; -1 = dynamic size)."""
    if node.op == "get_attr":
        value = get_attr_value(node, gm)
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None
    info = tensor_info(node)
    return info[0] if info else None


def bind_parameter(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Bind a NEW ``nn.Parameter`` holding ``value`` at ``target`` (the old object is left untouched).

    The new parameter keeps the old one's ``requires_grad`` (True when the old value was a plain tensor).
    """
    owner, name = split_target(target)
    module = root.get_submodule(owner)
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value, requires_grad=getattr(old, "requires_grad", True)))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def exclusive_tensor(gm: GraphModule, node: object, user: Node) -> torch.Tensor | None:
    """The tensor of ``get_attr`` ``node`` when only ``user`` reads it (no other node, alias or module call)."""
    tensor = get_attr_value(node, gm)
    if not isinstance(node, Node) or not isinstance(tensor, torch.Tensor) or list(node.users) != [user]:
        return None
    target = str(node.target)
    for other in gm.graph.nodes:
        if other is node:
            continue
        if other.op == "get_attr":
            seen = get_attr_value(other, gm)
            if str(other.target) == target or (isinstance(seen, torch.Tensor) and _same_storage(seen, tensor)):
                return None
        elif other.op == "call_module" and target.startswith(f"{other.target}."):
            return None  # the owning module is also called as a module
    named = chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False))
    if sum(1 for _, t in named if t is tensor) > 1:
        return None  # tied under another name
    return tensor


def rescale_weight_and_bias(gm: GraphModule, layer: Node, weight_node: object, bias_node: object,
                            rescale: Callable[[torch.Tensor, bool], torch.Tensor | None]) -> bool:
    """Rebind ``layer``'s weight and bias to ``rescale(tensor, is_bias)``; False (nothing rebound) when it cannot.

    Both must be floating-point ``get_attr`` tensors that only ``layer`` reads (:func:`exclusive_tensor`; the bias
    node may be None), ``rescale`` must return a tensor for each (None: refuse) and every value must be finite.
    The new tensors are new ``nn.Parameter`` objects (:func:`bind_parameter`), so the originals are untouched.
    """
    weight = exclusive_tensor(gm, weight_node, layer)
    if weight is None or not weight.is_floating_point():
        return False
    bias = None
    if bias_node is not None:
        bias = exclusive_tensor(gm, bias_node, layer)
        if bias is None or not bias.is_floating_point():
            return False
    with torch.no_grad():
        rescaled = [rescale(t.detach(), is_bias) for t, is_bias in ((weight, False), (bias, True)) if t is not None]
    if any(t is None or not bool(torch.isfinite(t).all()) for t in rescaled):
        return False
    bind_parameter(gm, str(weight_node.target), rescaled[0])
    if bias is not None:
        bind_parameter(gm, str(bias_node.target), rescaled[1])
    return True
