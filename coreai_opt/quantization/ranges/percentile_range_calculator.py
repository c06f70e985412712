"""``"percentile"`` range calculator: drop the outer ``(100 - p)`` % of values on each side.

For every row with ``N`` counted values, histogram counts ``c_j``, cumulative counts ``C_j = Σ_{i≤j} c_i`` and
bin ``j`` covering ``[e_j, e_j + w)``, the value of rank ``t ∈ (0, N]`` is read from the histogram with the mass
of each bin spread uniformly over it (linear interpolation inside the bin):

    ``j = min{j : C_j ≥ t}``,   ``value(t) = e_j + (t - C_{j-1}) / c_j · w``.

Then ``max = value(p/100 · N)`` and ``min = value((1 - p/100) · N)``, both clipped to the exact observed
``[min, max]`` of the row. ``p = 100`` therefore gives the observed min / max.

Accuracy: the estimate lies in the same bin as the ``⌈t⌉``-th smallest value, so it is within one bin width
``w = 2^(k+1) / num_bins`` of that order statistic (``2^k`` the smallest power of two above ``max|x|``; outliers
widen the bins). Percentile definitions that interpolate between neighbouring order statistics (numpy's
default) can differ by more where the tail is sparse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from coreai_opt.quantization.ranges.histogram import RowHistogram
from coreai_opt.quantization.ranges.histogram_range_calculator import HistogramRangeCalculatorBase
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.spec.granularity import Granularity

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["PercentileRangeCalculator", "histogram_quantile"]


def histogram_quantile(hist: RowHistogram, fraction: float) -> Tensor:
    """Per-row value below which ``fraction`` of the counted values lie (float64, ``(R,)``).

    Args:
        hist: A histogram with at least one row.
        fraction: In ``[0, 1]``; the rank is ``t = fraction · N`` (floored at a tiny positive rank so that
            ``fraction = 0`` gives the left edge of the first non-empty bin).

    Rows without counts return ``0``.
    """
    counts = hist.counts.double()
    cdf = counts.cumsum(dim=1)
    total = cdf[:, -1:]
    target = fraction * total
    # Snap float noise (99.9 / 100 = 0.9990000000000001) so that an integral rank stays integral.
    nearest = torch.round(target)
    target = torch.where((target - nearest).abs() <= 1e-9 * total.clamp(min=1.0), nearest, target).clamp(min=1e-9)
    j = torch.searchsorted(cdf, target, side="left").clamp(max=hist.num_bins - 1)
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    in_bin = counts.gather(1, j)
    frac = ((target - before) / in_bin.clamp(min=1.0)).clamp(0.0, 1.0)
    width = hist.bin_width().unsqueeze(1)
    value = (j.double() - hist.num_bins // 2 + frac) * width
    return torch.where(total > 0, value, torch.zeros_like(value)).squeeze(1)


@RANGE_CALCULATORS.register("percentile")
class PercentileRangeCalculator(HistogramRangeCalculatorBase):
    """Range ``[(100 - p)-th percentile, p-th percentile]`` per row, from a mergeable histogram.

    Args:
        granularity: How elements are grouped into qparams.
        num_bins: Histogram bins per row (power of two ``>= 16``).
        percentile: ``p`` in ``(50, 100]`` (default 99.99).
    """

    def __init__(
        self, granularity: Granularity | None = None, *, num_bins: int = 2048, percentile: float = 99.99
    ) -> None:
        super().__init__(granularity, num_bins=num_bins)
        if not 50.0 < float(percentile) <= 100.0:
            raise ValueError(
                f"percentile={percentile!r} must satisfy 50 < percentile <= 100 (e.g. 99.99 keeps all but the "
                "0.01 % most extreme values on each side)"
            )
        self.percentile = float(percentile)

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> PercentileRangeCalculator:  # noqa: D102
        return cls(spec.granularity, num_bins=spec.num_bins, percentile=spec.percentile)

    def _rows_range(self, hist: RowHistogram) -> tuple[Tensor, Tensor]:
        p = self.percentile / 100.0
        return histogram_quantile(hist, 1.0 - p), histogram_quantile(hist, p)
