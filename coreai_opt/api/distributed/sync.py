"""Orchestration of the statistics merge: which calculators, in which order, with which checks.

The merge rules themselves belong to the spec layer: every stateful qparams calculator merges with
``sync_statistics(group, *, only_order_dependent=False)`` and every range calculator with
``all_reduce(group)`` (see :mod:`coreai_opt.quantization.spec.builtin_qparams_calculators`,
:mod:`~coreai_opt.quantization.ranges.range_calculator`, :mod:`~coreai_opt.quantization.ranges.histogram`).
This module only runs them on every rank in the same (sorted module-name) order, after the status
collective, with the per-collective timeout, and turns their errors into :class:`DistributedSyncError`.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from coreai_opt.api.distributed.process_group import (
    DistributedSyncError,
    Timeout,
    collective_error,
    is_distributed,
    run_checked,
)
from coreai_opt.api.distributed.status import exchange_status
from coreai_opt.quantization.collectives import collective_timeout, comm_device, torch_distributed
from coreai_opt.quantization.ranges.range_calculator import RangeCalculatorBase
from coreai_opt.quantization.spec.qparams_calculator import QParamsCalculatorBase, StatefulQParamsCalculatorBase

__all__ = [
    "order_dependent_items", "quantizer_fingerprint", "stateful_calculators", "sync_items", "sync_statistics",
]


def stateful_calculators(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every stateful qparams calculator and every free-standing range calculator, sorted by module name."""
    modules = dict(model.named_modules())
    owners = [n for n, m in modules.items() if isinstance(m, QParamsCalculatorBase)]
    found: list[tuple[str, nn.Module]] = []
    for name, module in modules.items():
        if isinstance(module, StatefulQParamsCalculatorBase):
            found.append((name, module))
        elif isinstance(module, RangeCalculatorBase) and not any(
            owner == "" or name.startswith(f"{owner}.") for owner in owners
        ):
            found.append((name, module))
    return sorted(found, key=lambda item: item[0])


def order_dependent_items(items: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The calculators whose merge depends on when it happens (``order_dependent``: moving averages)."""
    return [(name, module) for name, module in items if getattr(module, "order_dependent", False)]


def quantizer_fingerprint(items: list[tuple[str, nn.Module]]) -> int:
    """A 56-bit hash of the calculators' names and types: ranks holding different quantizer sets disagree on it."""
    text = "\n".join(f"{name}:{type(module).__qualname__}" for name, module in items)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def sync_items(
    items: list[tuple[str, nn.Module]], group: object | None, timeout: Timeout, *, only_order_dependent: bool = False
) -> int:
    """Merge ``items`` (already agreed on by every rank); returns how many had statistics on some rank.

    Collectives: one MAX of the per-calculator "has statistics" flags (calculators that no rank observed are
    left alone), then each remaining calculator's own merge, in ``items`` order.
    """
    if not items:
        return 0
    dist = torch_distributed()
    flags = torch.tensor([int(bool(module.has_statistics)) for _, module in items], dtype=torch.int64)
    flags = flags.to(comm_device(group))
    run_checked(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=group, timeout=timeout, what="observed flags")
    todo = [item for item, flag in zip(items, flags.cpu().tolist(), strict=True) if flag]
    with collective_timeout(timeout):
        for name, module in todo:
            try:
                if isinstance(module, QParamsCalculatorBase):
                    module.sync_statistics(group, only_order_dependent=only_order_dependent)
                else:
                    module.all_reduce(group)
            except ValueError as exc:  # raised identically on every rank by the calculators' own checks
                raise DistributedSyncError(f"{name}: {exc}") from exc
            except DistributedSyncError:
                raise
            except RuntimeError as exc:
                raise collective_error(f"statistics of {name}", timeout, exc) from exc
    return len(todo)


def _set_batch_counts(items: list[tuple[str, nn.Module]], num_batches: int | None) -> None:
    """This rank's moving-average weight: ``num_batches``, or 1, for every calculator with statistics (else 0)."""
    for _, module in items:
        if isinstance(module, StatefulQParamsCalculatorBase):
            weight = 1 if num_batches is None else int(num_batches)
            module.batches_since_sync = weight if module.has_statistics else 0


def sync_statistics(
    model: nn.Module,
    group: object | None = None,
    *,
    num_batches: int | None = None,
    timeout: Timeout = None,
    only_order_dependent: bool = False,
) -> int:
    """Merge the statistics of every stateful calculator of ``model`` across the ranks of ``group``.

    Calculators are visited in sorted module-name order and merged by their own spec-layer methods
    (``sync_statistics`` / ``all_reduce``); after the call every rank holds identical statistics. Qparams
    are *not* recomputed: commit afterwards (``calibrate`` does). Every rank must call it, also ranks that
    saw no data. Moving averages merge as ``m = Σ_r w_r·m_r / Σ_r w_r`` with ``w_r`` as below.

    Args:
        model: A prepared model (or any module containing calculators).
        group: Process group (default: the world).
        num_batches: Batches this rank observed since the last sync: its moving-average weight ``w_r``
            (it replaces the calculators' own ``batches_since_sync``). Default: 1 for a calculator with
            statistics, 0 otherwise. ``CalibrationSync`` uses the calculators' own counts instead.
        timeout: Seconds (or timedelta) each collective may wait; None uses the process group timeout.
        only_order_dependent: Merge only order-dependent calculators (``moving_average``); used by
            ``sync="every_batch"``, whose order-independent statistics are merged once at the end.

    Returns:
        The number of calculators merged (those observed on at least one rank); 0 without a process group.

    Raises:
        DistributedSyncError: on every rank, when a rank reported a failure, ranks hold different quantizer
            sets or shapes, or a collective timed out.
    """
    if not is_distributed():
        return 0
    items = stateful_calculators(model)
    if only_order_dependent:
        items = order_dependent_items(items)
    exchange_status(group, timeout, fingerprint=quantizer_fingerprint(items), count=len(items))
    _set_batch_counts(items, num_batches)
    return sync_items(items, group, timeout, only_order_dependent=only_order_dependent)
