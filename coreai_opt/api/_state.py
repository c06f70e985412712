"""Shared look-ups of the API modules: the coreai_opt graph metadata and the quantizer modules."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from coreai_opt.passes.node_meta import META_KEY, Role, get_meta
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize, StatefulQParamsCalculatorBase

__all__ = ["graph_meta", "fake_quantizers", "bias_quantizers", "weight_quantizer_inputs", "commit_weight_qparams"]


def graph_meta(model: object, caller: str) -> dict[str, Any]:
    """Return ``model.meta["coreai_opt"]`` or raise naming the step that produces it."""
    meta = getattr(model, "meta", None)
    if not isinstance(model, fx.GraphModule) or not isinstance(meta, dict) or META_KEY not in meta:
        raise TypeError(
            f"{caller} expects a model returned by coreai_opt.prepare(...), got {type(model).__name__}; "
            "call prepared = coreai_opt.prepare(model, config, example_inputs) first"
        )
    return meta[META_KEY]


def fake_quantizers(model: nn.Module) -> list[tuple[str, FakeQuantize]]:
    """All FakeQuantize submodules with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FakeQuantize)]


def bias_quantizers(model: nn.Module) -> list[tuple[str, BiasFakeQuantize]]:
    """All BiasFakeQuantize submodules (derived int32 biases) with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BiasFakeQuantize)]


def weight_quantizer_inputs(gm: fx.GraphModule) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """``(weight quantizer, weight tensor)`` for every weight quantizer call on a ``get_attr``."""
    pairs = []
    for node in gm.graph.nodes:
        info = get_meta(node).quantizer
        if info is None or info.role is not Role.WEIGHT or node.op != "call_module":
            continue
        source = node.args[0]
        if isinstance(source, fx.Node) and source.op == "get_attr":
            owner, _, attr = str(source.target).rpartition(".")
            pairs.append((gm.get_submodule(str(node.target)), getattr(gm.get_submodule(owner), attr)))
    return pairs


def commit_weight_qparams(gm: fx.GraphModule) -> int:
    """Recompute every weight quantizer's qparams from the current weight (no calibration data needed).

    Returns:
        The number of weight quantizers committed.
    """
    count = 0
    with torch.no_grad():
        for fq, weight in weight_quantizer_inputs(gm):
            calculator = fq.calculator
            if not isinstance(calculator, StatefulQParamsCalculatorBase) or fq.export_mode:
                continue
            calculator.reset_statistics()
            calculator.observe(weight.detach())
            fq.commit()
            count += 1
    return count
