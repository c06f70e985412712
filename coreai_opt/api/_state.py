"""Shared look-ups of the API modules: the quantizer modules of a prepared model and the weight commits."""

from __future__ import annotations

import weakref

import torch
from torch import fx, nn

from coreai_opt.passes.graph_attrs import attr_value
from coreai_opt.passes.node_meta import Role, get_meta
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize

__all__ = ["fake_quantizers", "bias_quantizers", "weight_quantizer_inputs", "commit_weight_qparams"]


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
            pairs.append((gm.get_submodule(str(node.target)), attr_value(gm, source.target)))
    return pairs


#: Weight quantizer -> (weak reference to the weight it was committed from, that weight's version). Kept outside
#: the modules so that pickling / deep-copying a model never meets a weak reference.
_COMMITTED_FROM: weakref.WeakKeyDictionary[FakeQuantize, tuple[weakref.ref[torch.Tensor], int]] = (
    weakref.WeakKeyDictionary()
)


def _unchanged_since_commit(fq: FakeQuantize, weight: torch.Tensor) -> bool:
    """True when ``fq`` holds qparams committed from this very tensor and it was not modified in place since.

    ``Tensor._version`` grows with every in-place change (optimizer steps, ``load_state_dict``, ``copy_``); a
    replaced parameter is a different object, which the weak reference tells apart even if its id is reused.
    """
    record = _COMMITTED_FROM.get(fq)
    return (record is not None and record[0]() is weight and record[1] == weight._version
            and fq.has_qparams)


def commit_weight_qparams(gm: fx.GraphModule, *, force: bool = False) -> int:
    """Compute every weight quantizer's qparams from the current weight (no calibration data needed).

    A weight that is the same tensor, unchanged, as at its last commit is skipped (its qparams would come out the
    same), so calibrating repeatedly does not re-scan every weight each time.

    Args:
        gm: A prepared model.
        force: Recompute every weight quantizer even when its weight did not change.

    Returns:
        The number of weight quantizers committed.
    """
    count = 0
    with torch.no_grad():
        for fq, weight in weight_quantizer_inputs(gm):
            if not fq.stateful or fq.export_mode:
                continue
            if not force and _unchanged_since_commit(fq, weight):
                continue
            fq.reset_statistics()
            fq.observe(weight.detach())
            fq.commit()
            _COMMITTED_FROM[fq] = (weakref.ref(weight), weight._version)
            count += 1
    return count
