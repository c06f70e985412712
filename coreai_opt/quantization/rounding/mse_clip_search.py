"""``mse``: per-group clip search and least-squares scale, optionally weighted by the input second moments.

For every qparam group (row ``w`` of the rows view) and every clip factor ``α`` of :attr:`MSERounding.grid`, the
round-to-nearest qparams of ``α·range`` (:func:`~coreai_opt.quantization.rounding.rounding_math.rtn_qparams`) are
tried and the one with the smallest weighted error ``e = Σ_j h_j (w_j − ŵ_j)²`` is kept. Then
:attr:`MSERounding.refinements` rounds of ``s ← Σ h w (q − z) / Σ h (q − z)²; q ← round(w / s) + z`` are applied
while they lower ``e``; with an asymmetric scheme each round also tries the integer zero points ``z ± 1`` (with
their own least-squares scale), so the zero point stays an integer. ``α = 1`` is on the grid, so no group ends
worse than round-to-nearest.

``h_j = E[x_j²]`` of the input channel ``j`` the weight element multiplies, when the linear's inputs were observed
(``E‖x Wᵀ − x Ŵᵀ‖²`` then equals ``Σ_rows e`` up to the cross terms between channels, the diagonal
approximation NNCF's scale estimation uses); ``h = 1`` for weights without input statistics (data-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.rounding_math import (
    BestRows,
    least_squares_scale,
    quantize_rows,
    quantized_rows_error,
    rtn_qparams,
)
from coreai_opt.quantization.rounding.weight_rounding import (
    WEIGHT_ROUNDING,
    RoundedWeight,
    WeightRoundingBase,
    rows_result,
)
from coreai_opt.quantization.spec.granularity import Granularity, QuantizationScheme

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["MSERounding", "importance_rows", "search_rows"]


def importance_rows(weight: Tensor, granularity: Granularity, statistics: InputStatistics | None) -> Tensor | None:
    """``h`` in the rows view: ``E[x_j²]`` broadcast over the output rows of a 2-D ``[out, in]`` weight, else None."""
    if statistics is None or weight.dim() != 2 or statistics.num_channels != weight.shape[1]:
        return None
    moments = statistics.second_moment().to(weight.device)
    return granularity.to_rows(moments.reshape(1, -1).expand_as(weight).contiguous())


#: Elements of the rows view searched at a time (the search's temporaries are several times this, not the weight's).
SEARCH_CHUNK_ELEMENTS = 1 << 22


def search_rows(
    rows: Tensor, importance: Tensor | None, spec: QuantizationSpec, grid: tuple[float, ...], refinements: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Best ``(q, scale, zero_point)`` per row over the clip grid, then least-squares scale refinements.

    Rows are searched independently, in chunks of about :data:`SEARCH_CHUNK_ELEMENTS` elements: a chunk stops
    refining when none of *its* rows improved, and a row that did not improve in a round has the same state in the
    next one, so every row gets exactly the result of the whole-tensor search.
    """
    step = max(1, SEARCH_CHUNK_ELEMENTS // max(1, rows.shape[1]))
    if rows.shape[0] <= step:
        return _search_chunk(rows, importance, spec, grid, refinements)
    parts = [_search_chunk(rows[i:i + step], None if importance is None else importance[i:i + step], spec, grid,
                           refinements) for i in range(0, rows.shape[0], step)]
    return tuple(torch.cat([part[k] for part in parts]) for k in range(3))  # type: ignore[return-value]


def _search_chunk(
    rows: Tensor, importance: Tensor | None, spec: QuantizationSpec, grid: tuple[float, ...], refinements: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`search_rows` on one chunk of rows."""
    qmin, qmax = int(spec.quant_min), int(spec.quant_max)
    best: BestRows | None = None
    for alpha in grid:
        s, z = rtn_qparams(rows, spec.dtype_info, spec.qscheme, alpha)
        q, err = quantized_rows_error(rows, s, z, qmin, qmax, importance)
        if best is None:
            best = BestRows(err, q, s, z)
        else:
            best.offer(err, q, s, z)
    assert best is not None, "the clip grid is never empty (it starts with 1.0)"
    shifts = (0, -1, 1) if QuantizationScheme(spec.qscheme) is QuantizationScheme.ASYMMETRIC else (0,)
    for _ in range(refinements):
        improved = False
        for shift in shifts:
            z = torch.clamp(best.zero_point + shift, qmin, qmax)
            s = least_squares_scale(rows, quantize_rows(rows, best.scale, z, qmin, qmax), z, importance)
            q, err = quantized_rows_error(rows, s, z, qmin, qmax, importance)
            improved |= best.offer(err, q, s, z)
        if not improved:
            break
    return best.result()


@WEIGHT_ROUNDING.register("mse")
class MSERounding(WeightRoundingBase):
    """Clip search + least-squares scale per qparam group (module docstring); data-free without input statistics.

    Class attributes (subclass and register to change them):
        grid: Clip factors tried (1.0 first).
        refinements: Least-squares scale rounds after the search.
    """

    statistics_kind: ClassVar[str | None] = "moments"
    grid: ClassVar[tuple[float, ...]] = tuple(round(1.0 - 0.025 * i, 3) for i in range(21))
    refinements: ClassVar[int] = 4

    def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:  # noqa: D102
        granularity = self.spec.granularity
        rows = granularity.to_rows(weight)
        q, s, z = search_rows(rows, importance_rows(weight, granularity, statistics), self.spec, self.grid,
                              self.refinements)
        return rows_result(q, s, z, weight, granularity)
