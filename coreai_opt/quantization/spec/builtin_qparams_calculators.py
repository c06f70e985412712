"""The built-in qparams calculators: ``static``, ``moving_average``, ``global_minmax`` and ``dynamic``.

=================  =========  ===================================================================
key                state      range used at commit time
=================  =========  ===================================================================
``static``         buffers    the range calculator's range (minmax: the last tensor; histograms:
                              everything observed)
``moving_average`` buffers    EMA ``m ← (1 − c)·m + c·batch`` of the per-batch min and max,
                              initialised by the first batch (``c = spec.averaging_constant``)
``global_minmax``  buffers    running elementwise ``min`` of mins and ``max`` of maxes
``dynamic``        none       the current tensor only, recomputed every call (variable shapes)
=================  =========  ===================================================================

Running statistics are buffers (``running_min`` / ``running_max``), so they round-trip through
``state_dict``. A qparam group whose batch had no finite value leaves its running value unchanged, and an
empty tensor is no batch at all.

``sync_statistics(group=None, *, only_order_dependent=False)`` merges the statistics across
``torch.distributed`` ranks so that every rank ends identical (per qparam group, ``r`` over the ranks):

=================  ====================================================================================
key                merge
=================  ====================================================================================
``static``         the range calculator's ``all_reduce`` (minmax: ``MIN_r min_r`` / ``MAX_r max_r`` of
                   the last batches; histograms: ``SUM_r`` of the counts on the common grid, exact)
``global_minmax``  ``running_min = MIN_r running_min_r``, ``running_max = MAX_r running_max_r`` (exact)
``moving_average`` ``m = Σ_r w_r·m_r / Σ_r w_r`` for ``m`` = running min and running max, where ``w_r`` is
                   rank ``r``'s ``batches_since_sync``; float64 sums in rank order, cast back to float32
``dynamic``        nothing (stateless)
=================  ====================================================================================

The running calculators also merge their range calculator's last-batch range (unless
``only_order_dependent``), so that every buffer ends identical. A rank that saw no data joins every
collective: the qparam shape is agreed first (:func:`~coreai_opt.quantization.collectives.agree_shape`)
and it contributes ``+inf`` / ``-inf`` for min / max and weight 0. Ranks with ``w_r = 0`` and groups that
are not finite on a rank contribute nothing to the moving average; where ``Σ_r w_r = 0`` the value stays
unchanged (so a repeated merge is a no-op).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.collectives import agree_shape, all_gather, all_reduce
from coreai_opt.quantization.ranges.range_calculator import replace_buffer
from coreai_opt.quantization.spec.qparams_calculator import (
    QPARAMS_CALCULATORS,
    StatefulQParamsCalculatorBase,
    StatelessQParamsCalculatorBase,
)

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = [
    "QPARAMS_CALCULATORS",
    "StaticQParamsCalculator",
    "MovingAverageQParamsCalculator",
    "GlobalMinMaxQParamsCalculator",
    "DynamicQParamsCalculator",
]


@QPARAMS_CALCULATORS.register("static")
class StaticQParamsCalculator(StatefulQParamsCalculatorBase):
    """Qparams from the range calculator's current statistics (weights; histogram calibration)."""


class _RunningRangeQParamsCalculator(StatefulQParamsCalculatorBase):
    """Shared buffers and plumbing of calculators that keep a running ``(min, max)`` per qparam group."""

    running_min: Tensor
    running_max: Tensor

    def __init__(self, spec: QuantizationSpec) -> None:
        super().__init__(spec)
        self.register_buffer("running_min", torch.empty(0))
        self.register_buffer("running_max", torch.empty(0))

    @property
    def has_statistics(self) -> bool:  # noqa: D102
        return self.running_min.numel() > 0 and bool(torch.isfinite(self.running_min).any())

    def observe(self, x: Tensor) -> None:
        """Update the running range with the per-group min/max of ``x`` (nothing in export mode).

        An empty ``x`` is no batch: the running range and :attr:`batches_since_sync` stay as they are.
        """
        if self.export_mode or x.numel() == 0:
            return
        rc = self.range_calculator
        rc.update(x)
        self.__dict__["batches_since_sync"] += 1  # plain int attribute; skips nn.Module.__setattr__ (hot path)
        if not rc.has_statistics:  # no finite value at all (warned): the batch adds nothing
            return
        batch_min, batch_max = rc.compute_range()
        if self.running_min.numel() == 0:
            self.running_min = torch.full_like(batch_min, float("inf"))
            self.running_max = torch.full_like(batch_max, float("-inf"))
        elif self.running_min.shape != batch_min.shape:
            raise ValueError(
                f"{self.name}: qparam shape changed from {tuple(self.running_min.shape)} to "
                f"{tuple(batch_min.shape)}; a stateful calculator keeps one shape. Use a "
                "StatelessQParamsCalculatorBase (qparams_calculator='dynamic') for tensors whose quantized dimensions "
                "vary."
            )
        new_min, new_max = self._merge(batch_min, batch_max)
        if not getattr(rc, "all_finite", False):  # keep the running range of groups with no finite value
            valid = torch.isfinite(batch_min)
            new_min = torch.where(valid, new_min, self.running_min)
            new_max = torch.where(valid, new_max, self.running_max)
        replace_buffer(self, "running_min", new_min)
        replace_buffer(self, "running_max", new_max)

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sync_statistics(self, group: object | None = None, *, only_order_dependent: bool = False) -> None:
        """Merge the running range across the ranks of ``group`` (rule: see the subclass), then the last-batch range.

        Collectives: the shape agreement, the running-range merge (:meth:`_sync_running`) and, unless
        ``only_order_dependent``, the range calculator's ``all_reduce``. A rank that observed nothing adopts
        the agreed shape with ``(+inf, -inf)`` before the merge; when no rank observed anything, the running
        range stays as it is. Resets :attr:`batches_since_sync`.

        Args:
            group: Process group (default: the world). Every rank of it must call this method.
            only_order_dependent: Skip the last-batch range; return at once unless :attr:`order_dependent`.

        Raises:
            ValueError: on every rank, when ranks observed different qparam shapes.
        """
        if only_order_dependent and not self.order_dependent:
            return
        local = tuple(self.running_min.shape) if self.running_min.numel() > 0 else None
        shape = agree_shape(local, group, what=self.name)
        if shape is not None:
            if local is None:
                self.running_min = torch.full(shape, float("inf"), device=self.running_min.device)
                self.running_max = torch.full(shape, float("-inf"), device=self.running_max.device)
            self._sync_running(group)
        if not only_order_dependent:
            self.range_calculator.all_reduce(group)
        self.batches_since_sync = 0

    def _sync_running(self, group: object | None) -> None:
        """Merge ``running_min`` / ``running_max`` (same shape on every rank) across ``group``."""
        raise NotImplementedError

    def observed_range(self) -> tuple[Tensor, Tensor]:  # noqa: D102
        if not self.has_statistics:
            raise RuntimeError(f"{self.name}: no tensor observed yet; observe data before commit()")
        return self.running_min, self.running_max

    def reset_statistics(self) -> None:  # noqa: D102
        super().reset_statistics()
        self.running_min = torch.empty(0, device=self.running_min.device)
        self.running_max = torch.empty(0, device=self.running_max.device)


@QPARAMS_CALCULATORS.register("moving_average")
class MovingAverageQParamsCalculator(_RunningRangeQParamsCalculator):
    """EMA of the per-batch range: ``m ← (1 − c)·m + c·batch_min`` (same for max); the first batch initialises.

    With ``c = 0.01`` the EMA moves slowly; calibration resets statistics first so the prepare-time example
    input does not dominate.

    Across ranks the EMA is order-dependent, so no sharded run reproduces a single-process EMA; the merge is
    *defined* as the batch-weighted mean ``m = Σ_r w_r·m_r / Σ_r w_r`` (see the module docs).
    """

    order_dependent: ClassVar[bool] = True

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
        c = self.spec.averaging_constant
        first = ~torch.isfinite(self.running_min)
        ema_min = (1.0 - c) * self.running_min + c * batch_min
        ema_max = (1.0 - c) * self.running_max + c * batch_max
        return torch.where(first, batch_min, ema_min), torch.where(first, batch_max, ema_max)

    def _sync_running(self, group: object | None) -> None:
        """``m = Σ_r w_r·m_r / Σ_r w_r`` per element, ``w_r`` = rank ``r``'s :attr:`batches_since_sync`.

        One ``all_gather`` of ``[values, weights]`` (float64); a non-finite entry weighs 0 on its rank. The
        sums run in rank order, so every rank computes the same bits; where ``Σ_r w_r = 0`` the local value
        stays.
        """
        local = torch.cat([self.running_min.reshape(-1), self.running_max.reshape(-1)]).double()
        weights = torch.where(
            torch.isfinite(local), torch.full_like(local, float(self.batches_since_sync)), torch.zeros_like(local)
        )
        mine = torch.stack([torch.where(weights > 0, local, torch.zeros_like(local)), weights])
        numerator, total = torch.zeros_like(local), torch.zeros_like(local)
        for values_weights in all_gather(mine, group):  # rank order
            numerator = numerator + values_weights[1] * values_weights[0]
            total = total + values_weights[1]
        merged = torch.where(total > 0, numerator / torch.where(total > 0, total, torch.ones_like(total)), local)
        count = self.running_min.numel()
        self.running_min = merged[:count].reshape(self.running_min.shape).to(self.running_min.dtype)
        self.running_max = merged[count:].reshape(self.running_max.shape).to(self.running_max.dtype)


@QPARAMS_CALCULATORS.register("global_minmax")
class GlobalMinMaxQParamsCalculator(_RunningRangeQParamsCalculator):
    """Running elementwise ``min`` of batch minima and ``max`` of batch maxima."""

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
        return torch.minimum(self.running_min, batch_min), torch.maximum(self.running_max, batch_max)

    def _sync_running(self, group: object | None) -> None:
        """``running_min = MIN_r running_min_r``, ``running_max = MAX_r running_max_r`` (one MIN, one MAX)."""
        self.running_min = all_reduce(self.running_min, "min", group)
        self.running_max = all_reduce(self.running_max, "max", group)


@QPARAMS_CALCULATORS.register("dynamic")
class DynamicQParamsCalculator(StatelessQParamsCalculatorBase):
    """Qparams from each tensor alone, e.g. per-token with ``PerChannel(axis=-2)`` on ``(batch, seq, hidden)``.

    The qparam shape follows the tensor (a new sequence length gives a new scale length). Nothing is
    cached, so it cannot be frozen for ONNX export.
    """
