r"""Rewrite ``x.new_zeros(size)`` and its kin to factories that do not read ``x``.

``x.new_zeros(size)`` (``new_ones``, ``new_empty``, ``new_full``) takes only ``x``'s dtype and device: no value of
``x`` reaches the result. In the captured graph it is still a reader of ``x``, so ``x`` and everything computing
it look live, and a quantizer is inserted on them; torch's exporter writes the result as a constant, drops the
chain as dead, and verify finds an activation eager quantized with no node in the file (transformers'
DeepSeek-V4 compressor on a prompt shorter than its window: ``kv[:, :0].new_zeros(...)`` kept ``kv_proj`` alive).

With the dtype and device recorded at capture (``tensor_meta`` / ``val``), each such node becomes

.. math::

    \mathrm{new\_zeros}(x, S) \;\to\; \mathrm{zeros}(S,\ \mathrm{dtype}{=}x.\mathrm{dtype},\
    \mathrm{device}{=}x.\mathrm{device})

(the same tensor), after which the chain nobody else reads is removed as dead code. A node with an explicit
``dtype=`` keeps it; one whose input has no recorded dtype is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from coreai_opt.graph.pass_result import PassResult

__all__ = ["factories_from_metadata"]

aten = torch.ops.aten

#: ``new_*`` op or method -> (the factory, whether a fill value follows the size).
_FACTORIES: dict[Any, tuple[Any, bool]] = {
    aten.new_zeros.default: (torch.zeros, False), aten.new_ones.default: (torch.ones, False),
    aten.new_empty.default: (torch.empty, False), aten.new_full.default: (torch.full, True),
    "new_zeros": (torch.zeros, False), "new_ones": (torch.ones, False), "new_empty": (torch.empty, False),
    "new_full": (torch.full, True),
}


def _dtype_and_device(node: Node) -> tuple[torch.dtype, torch.device] | None:
    val = node.meta.get("val")
    if isinstance(val, Tensor):
        return val.dtype, val.device
    meta = node.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    return (dtype, torch.device("cpu")) if isinstance(dtype, torch.dtype) else None


def factories_from_metadata(gm: GraphModule) -> PassResult:
    """Rewrite each ``new_zeros`` / ``new_ones`` / ``new_empty`` / ``new_full`` node (module docstring).

    Args:
        gm: A captured GraphModule with ``val`` or ``tensor_meta`` on its nodes.

    Returns:
        ``PassResult`` counting the nodes rewritten.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        try:
            found = _FACTORIES.get(node.target)
        except TypeError:  # unhashable target
            continue
        source = node.args[0] if node.args else None
        recorded = _dtype_and_device(source) if isinstance(source, Node) else None
        if found is None or recorded is None or len(node.args) < 2:
            continue
        factory, filled = found
        size = node.args[1]
        if node.op == "call_method" and not filled and len(node.args) > 2:
            size = list(node.args[1:])  # x.new_zeros(2, 3)
        elif filled and len(node.args) < 3 and "fill_value" not in node.kwargs:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device", "layout", "pin_memory")}
        kwargs.setdefault("dtype", recorded[0])
        kwargs.setdefault("device", recorded[1])
        if filled:
            node.args = (size, node.args[2] if len(node.args) > 2 else node.kwargs["fill_value"])
        else:
            node.args = (size,)
        node.op, node.target, node.kwargs = "call_function", factory, kwargs
        changes += 1
    return PassResult.after_edits(gm, changes)
