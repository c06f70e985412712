"""Which values of a captured graph are computed from its integer inputs (token positions, masks) only.

Such a value (a rotary embedding's ``position · inv_freq`` angles and their cos / sin, a mask built from
``attention_mask``) has a range that grows with the sequence; :mod:`coreai_opt.passes.annotate` leaves it float.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from coreai_opt.graph.graph_attrs import get_attr_value
from coreai_opt.graph.node_meta import get_meta, tensor_info
from coreai_opt.graph.op_kinds import WEIGHTED_KINDS

__all__ = ["integer_input_derived", "is_float_tensor"]


def is_float_tensor(node: object, gm: GraphModule) -> bool:
    """True when ``node`` is a graph value (or constant attribute) holding a floating-point tensor."""
    if not isinstance(node, Node):
        return False
    if node.op == "get_attr":
        value = get_attr_value(node, gm)
        return isinstance(value, torch.Tensor) and value.is_floating_point()
    info = tensor_info(node)
    return info is not None and info[1].is_floating_point


def integer_input_derived(gm: GraphModule) -> set[Node]:
    """Nodes computed from the integer graph inputs (token positions, masks) and constants only.

    One forward walk with three states: an integer placeholder (``position_ids``, ``attention_mask``) is
    *derived*, a float placeholder is *data*, parameters / constants and non-tensor values (sizes) are *neutral*.
    A node with a data input is data; a weighted op (an embedding lookup, a linear) makes data of what it reads;
    otherwise a tensor with a derived input is derived. A rotary embedding's angles ``position · inv_freq`` are
    derived: their range grows with the position, so a range calibrated on prompts of length ``T`` clips every
    position past ``T`` (measured: a Llama-style decoder calibrated on 132 positions scored +0.3 to +0.43 nats per
    token beyond them in w8a8, +0.002 before).

    An op with several tensor outputs (``split`` of a fused q / k / v projection, ``chunk``, ``unbind``) passes its
    state on to the ``getitem`` of each output. Left neutral, it made GPT-2's attention scores neither data nor
    derived: the masked softmax reading them and the causal mask counted as derived, so its attention output, and
    with it ``c_proj``'s input, stayed float (``c_proj`` ran as a weight-only ``MatMulNBits``).
    """
    derived: set[Node] = set()
    data: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            (data if is_float_tensor(node, gm) else derived).add(node)
            continue
        if node.op in ("get_attr", "output"):
            continue
        if tensor_info(node) is None and not _tensors_out(node):
            continue  # sizes (``tokens.shape[1]``) are neutral: a parameter sliced to the length is data
        inputs = node.all_input_nodes
        if any(n in data for n in inputs) or get_meta(node).kind in WEIGHTED_KINDS:
            data.add(node)
        elif any(n in derived for n in inputs):
            derived.add(node)
    return derived


def _tensors_out(node: Node) -> bool:
    """True when ``node`` returns a tuple / list of tensors (read through ``getitem``)."""
    val = node.meta.get("val")
    if val is None:
        val = node.meta.get("tensor_meta")
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) or hasattr(v, "dtype") for v in val)
