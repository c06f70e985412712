"""Shared look-ups of the API modules: the quantizer modules of a prepared model and the weight commits."""

from __future__ import annotations

import weakref

import torch
from torch import fx, nn

from coreai_opt.graph.graph_attrs import attr_value
from coreai_opt.graph.node_meta import Role, called_quantizer
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize

__all__ = [
    "fake_quantizers",
    "bias_quantizers",
    "weight_quantizer_inputs",
    "stale_weight_quantizers",
    "commit_records",
    "restore_commit_records",
    "commit_weight_qparams",
    "commit_from_weight",
    "input_statistics",
]


def fake_quantizers(model: nn.Module) -> list[tuple[str, FakeQuantize]]:
    """All FakeQuantize submodules with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FakeQuantize)]


def bias_quantizers(model: nn.Module) -> list[tuple[str, BiasFakeQuantize]]:
    """All BiasFakeQuantize submodules (derived int32 biases) with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BiasFakeQuantize)]


def input_statistics(model: nn.Module) -> list[InputStatistics]:
    """The input statistics of data-aware weight rounding (called on the linears' input edges), in module order."""
    return [m for m in model.modules() if isinstance(m, InputStatistics) and m.attached]


def weight_quantizer_inputs(gm: fx.GraphModule) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """``(weight quantizer, weight tensor)`` for every weight quantizer call on a ``get_attr``."""
    pairs = []
    for node in gm.graph.nodes:
        quantizer = called_quantizer(gm, node, Role.WEIGHT)
        source = node.args[0] if quantizer is not None else None
        if isinstance(source, fx.Node) and source.op == "get_attr":
            pairs.append((quantizer, attr_value(gm, source.target)))
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


def stale_weight_quantizers(gm: fx.GraphModule, *, force: bool = False) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """The ``(weight quantizer, weight)`` pairs :func:`commit_weight_qparams` would recommit.

    Stateful, not frozen, and (unless ``force``) not committed from this very weight unchanged since, or holding
    new input statistics for its weight rounding.
    """
    return [
        (fq, weight) for fq, weight in weight_quantizer_inputs(gm)
        if fq.stateful and not fq.export_mode
        and (force or not _unchanged_since_commit(fq, weight) or fq.has_input_statistics)
    ]


def commit_records(quantizers: list[FakeQuantize]) -> dict[FakeQuantize, tuple[weakref.ref[torch.Tensor], int] | None]:
    """Which weight (and weight version) each quantizer was last committed from; see :func:`restore_commit_records`."""
    return {fq: _COMMITTED_FROM.get(fq) for fq in quantizers}


def restore_commit_records(records: dict[FakeQuantize, tuple[weakref.ref[torch.Tensor], int] | None]) -> None:
    """Put back records taken by :func:`commit_records` (a rolled-back calibration)."""
    for fq, record in records.items():
        if record is None:
            _COMMITTED_FROM.pop(fq, None)
        else:
            _COMMITTED_FROM[fq] = record


def commit_weight_qparams(gm: fx.GraphModule, *, force: bool = False) -> int:
    """Compute every weight quantizer's qparams from the current weight (no calibration data needed).

    A weight that is the same tensor, unchanged, as at its last commit is skipped (its qparams would come out the
    same), so calibrating repeatedly does not re-scan every weight each time, unless its weight rounding holds new
    calibration statistics (GPTQ, weighted MSE), which are then used.

    Args:
        gm: A prepared model.
        force: Recompute every weight quantizer even when its weight did not change.

    Returns:
        The number of weight quantizers committed.
    """
    count = 0
    for fq, weight in stale_weight_quantizers(gm, force=force):
        commit_from_weight(fq, weight)
        count += 1
    return count


def commit_from_weight(fq: FakeQuantize, weight: torch.Tensor) -> None:
    """Commit ``fq`` (qparams, and its rounding's result) from ``weight`` alone, and record which weight it was."""
    with torch.no_grad():
        fq.reset_statistics()
        fq.observe(weight.detach())
        fq.commit()
    _COMMITTED_FROM[fq] = (weakref.ref(weight), weight._version)
