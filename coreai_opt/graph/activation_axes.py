"""Refuse a per-channel / per-block activation quantizer whose axis changes size with the batch.

A stateful activation quantizer keeps one scale per index of its axis, fixed at calibration. On an axis that
follows the batch size (the batch axis itself, or any axis computed from it) that cannot work: the next batch of
another size breaks broadcasting (``The size of tensor a (2) must match the size of tensor b (4)``) or silently
reuses the scales of other samples. The check runs the prepared graph once more with every input's dimension 0
grown by one (all quantizers switched off) and compares the size of each such quantizer's axis with the
example's; exported graphs say it directly (a symbolic size). Stateless (dynamic) quantizers compute their scales
per tensor and are fine on any axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.graph.capture_error import source_of
from coreai_opt.graph.node_meta import Role, called_quantizer, get_meta, node_label, tensor_info
from coreai_opt.graph.op_kinds import MOVER_KINDS
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize, PerTensor

__all__ = ["check_activation_axes"]


def _candidates(gm: GraphModule) -> list[tuple[Node, FakeQuantize, int]]:
    """``(call node, quantizer, axis)`` of every call of a stateful non-per-tensor activation quantizer, in order."""
    found = []
    for node in gm.graph.nodes:
        fq = called_quantizer(gm, node, Role.ACTIVATION)
        if fq is None or isinstance(fq.spec.granularity, PerTensor) or not fq.stateful:
            continue
        found.append((node, fq, fq.spec.granularity.axis))
    return found


def _example_size(call: Node, axis: int) -> int | None:
    """The axis size at ``call`` in the example (-1: symbolic in an exported graph; None: unknown)."""
    info = tensor_info(call.args[0]) if isinstance(call.args[0], Node) else None
    if info is None or not -len(info[0]) <= axis < len(info[0]):
        return None
    return info[0][axis]


def _grown(value: Any) -> Any:
    """The example with dimension 0 of every tensor one larger (its first row repeated)."""
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: torch.cat([t, t[:1]]) if t.dim() >= 1 and t.shape[0] >= 1 else t, value)


def _sizes_at_grown_batch(gm: GraphModule, calls: list[tuple[Node, FakeQuantize, int]], args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> dict[Node, int] | None:
    """Axis size seen by each call when the batch grows by one (None when the graph cannot run that batch).

    A module runs its call sites in graph order, so the k-th call of a quantizer module is its k-th call node.
    """
    modules = [m for m in gm.modules() if isinstance(m, (FakeQuantize, BiasFakeQuantize))]
    flags = [(m, bool(m.fake_quant_enabled), bool(getattr(m, "observer_enabled", False))) for m in modules]
    order: dict[int, list[tuple[Node, int]]] = {}
    for call, fq, axis in calls:
        order.setdefault(id(fq), []).append((call, axis))
    seen: dict[Node, int] = {}
    counts: dict[int, int] = {}

    def record(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        k = counts.get(id(module), 0)
        counts[id(module)] = k + 1
        sites = order.get(id(module), [])
        if k < len(sites) and isinstance(inputs[0], torch.Tensor):
            call, axis = sites[k]
            seen[call] = inputs[0].shape[axis]

    hooks = [fq.register_forward_pre_hook(record) for fq in {id(c[1]): c[1] for c in calls}.values()]
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    training = gm.training
    try:
        gm.eval()
        for m in modules:
            m.enable_fake_quant(False)
            if isinstance(m, FakeQuantize):
                m.enable_observer(False)
        with torch.no_grad():
            gm(*_grown(args), **_grown(kwargs))
    except Exception:  # noqa: BLE001 - a graph that cannot run another batch size is not this check's concern
        return None
    finally:
        gm.train(training)
        with torch.no_grad():
            for name, value in gm.named_buffers():
                value.copy_(buffers[name])
        for hook in hooks:
            hook.remove()
        for m, fake, observe in flags:
            m.enable_fake_quant(fake)
            if isinstance(m, FakeQuantize):
                m.enable_observer(observe)
    return seen


def check_activation_axes(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise when a stateful per-channel/per-block activation quantizer's axis follows the batch size.

    Args:
        gm: The GraphModule after ``insert_quantizers``.
        args: The example positional inputs given to ``prepare``.
        kwargs: The example keyword inputs.

    Raises:
        CoreaiOptValueError: names the quantizer, the axis, the mover that put the batch there, and the fixes.
    """
    calls = _candidates(gm)
    if not calls:
        return
    sizes = {call: _example_size(call, axis) for call, _, axis in calls}
    grown = _sizes_at_grown_batch(gm, calls, args, kwargs) if -1 not in sizes.values() else {}
    for call, fq, axis in calls:
        example = sizes[call]
        if example == -1 or (grown and example is not None and grown.get(call, example) != example):
            shown = "symbolic" if example == -1 else example
            read = call.args[0]
            moved = ""
            if isinstance(read, Node) and get_meta(read).kind in MOVER_KINDS:
                moved = (f" (the value-moving op '{node_label(read)}' ({read.target}) at "
                         f"{source_of(read) or '(no source line recorded)'} moved the batch axis there)")
            raise CoreaiOptValueError(
                f"activation quantizer '{fq.name}' is {fq.spec.granularity.type_name} along axis {axis}, whose size "
                f"follows the batch size ({shown} in the example){moved}; its calibrated scales (one per index) "
                "cannot serve another batch size. Fix: quantize along a fixed-size axis (e.g. the channels, axis=1), "
                "use PerTensor(), or a stateless qparams_calculator='dynamic'"
            )
