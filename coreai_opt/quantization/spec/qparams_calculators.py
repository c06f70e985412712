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
``state_dict``. A qparam group whose batch had no finite value leaves its running value unchanged.
``sync_statistics(group)`` merges running statistics across ``torch.distributed`` ranks: MIN/MAX for
``global_minmax``, the mean of the per-rank EMAs for ``moving_average`` and the range calculator's own
merge for ``static``. Every rank must have observed data of the same qparam shape before syncing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

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
        """Update the running range with the per-group min/max of ``x`` (nothing in export mode)."""
        if self.export_mode:
            return
        self.range_calculator.update(x)
        batch_min, batch_max = self.range_calculator.compute_range()
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
        valid = torch.isfinite(batch_min)  # groups whose batch had at least one finite value
        self.running_min = torch.where(valid, new_min, self.running_min)
        self.running_max = torch.where(valid, new_max, self.running_max)

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
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
    """

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
        c = self.spec.averaging_constant
        first = ~torch.isfinite(self.running_min)
        ema_min = (1.0 - c) * self.running_min + c * batch_min
        ema_max = (1.0 - c) * self.running_max + c * batch_max
        return torch.where(first, batch_min, ema_min), torch.where(first, batch_max, ema_max)

    def sync_statistics(self, group: object | None = None) -> None:
        """Replace the running range by its mean over the ranks of ``group``."""
        import torch.distributed as dist

        world = dist.get_world_size(group=group)
        for buf in (self.running_min, self.running_max):
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            buf.div_(world)


@QPARAMS_CALCULATORS.register("global_minmax")
class GlobalMinMaxQParamsCalculator(_RunningRangeQParamsCalculator):
    """Running elementwise ``min`` of batch minima and ``max`` of batch maxima."""

    def _merge(self, batch_min: Tensor, batch_max: Tensor) -> tuple[Tensor, Tensor]:
        return torch.minimum(self.running_min, batch_min), torch.maximum(self.running_max, batch_max)

    def sync_statistics(self, group: object | None = None) -> None:
        """Reduce the running range with MIN / MAX over the ranks of ``group``."""
        import torch.distributed as dist

        dist.all_reduce(self.running_min, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(self.running_max, op=dist.ReduceOp.MAX, group=group)


@QPARAMS_CALCULATORS.register("dynamic")
class DynamicQParamsCalculator(StatelessQParamsCalculatorBase):
    """Qparams from each tensor alone, e.g. per-token with ``PerChannel(axis=-2)`` on ``(batch, seq, hidden)``.

    The qparam shape follows the tensor (a new sequence length gives a new scale length). Nothing is
    cached, so it cannot be frozen for ONNX export.
    """
