"""``"mse"`` range calculator: the clipping range that minimises the expected squared quantization error.

Every row's histogram stands for its data: bin ``j`` holds ``c_j`` values represented by its centre
``x_j = e_j + w/2`` clamped to the exact observed ``[min, max]`` (so a constant tensor is represented exactly).
Candidate ranges shrink the observed range by a factor ``f`` from a grid of ``num_candidates`` values evenly
spaced in ``[min_factor, 1]``:

    ``[min_f, max_f] = [f · min, f · max]``,   ``(s_f, z_f) = compute_qparams(min_f, max_f, dtype, qscheme)``

and the expected error, which includes the clipping error of the values outside ``[min_f, max_f]``, is

    ``E(f) = Σ_j c_j · (x_j - fq_f(x_j))²``

with ``fq_f(x) = (clamp(round(x / s_f) + z_f, qmin, qmax) - z_f) · s_f`` for integer dtypes and
``fq_f(x) = float8(clamp(x / s_f, -fmax, fmax)) · s_f`` (a cast to the float8 dtype, round-to-nearest-even)
for float8 dtypes. The calculator returns ``[min_f*, max_f*]`` with ``f* = argmin_f E(f)`` (the smallest
factor among ties). The search is vectorised over rows × candidates × non-empty bins, chunked so that one
step holds at most ``2^22`` elements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.ranges.histogram import RowHistogram
from coreai_opt.quantization.ranges.histogram_range_calculator import FormatSearchRangeCalculatorBase
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.spec.dtypes import QuantDtype
from coreai_opt.quantization.spec.granularity import QuantizationScheme
from coreai_opt.quantization.spec.qparams_math import compute_qparams, quant_range

if TYPE_CHECKING:
    pass

__all__ = ["MSERangeCalculator", "fake_quantize_values"]

_CHUNK_ELEMENTS = 2**22


def fake_quantize_values(
    values: Tensor, scale: Tensor, zero_point: Tensor | None, dtype_info: QuantDtype, qscheme: QuantizationScheme
) -> Tensor:
    """Fake-quantize ``values`` with broadcastable ``scale`` / ``zero_point`` (float64 result).

    Integer dtypes: ``(clamp(round(v / s) + z, qmin, qmax) - z) · s`` (round half to even).
    Float8 dtypes: ``float8(clamp(v / s, -fmax, fmax)) · s``.
    """
    scale = scale.double()
    if dtype_info.is_float:
        fmax = float(dtype_info.quant_max)
        scaled = (values / scale).clamp(-fmax, fmax)
        return scaled.to(dtype_info.storage_dtype).double() * scale
    qmin, qmax = quant_range(dtype_info, qscheme)
    zp = zero_point.double()
    q = torch.clamp(torch.round(values / scale) + zp, qmin, qmax)
    return (q - zp) * scale


@RANGE_CALCULATORS.register("mse")
class MSERangeCalculator(FormatSearchRangeCalculatorBase):
    """Range minimising the histogram's expected squared fake-quantization error (see module docs).

    Constructor arguments as :class:`FormatSearchRangeCalculatorBase`. Class attributes (subclass and register to
    change them): ``num_candidates``, the number of shrink factors searched (``>= 2``), and ``min_factor``, the
    smallest shrink factor, in ``(0, 1)``.
    """

    num_candidates: ClassVar[int] = 100
    min_factor: ClassVar[float] = 0.01

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__(**options)
        if isinstance(cls.num_candidates, bool) or not isinstance(cls.num_candidates, int) or cls.num_candidates < 2:
            raise ValueError(f"{cls.__name__}.num_candidates={cls.num_candidates!r} must be an int >= 2 (default 100)")
        if not 0.0 < float(cls.min_factor) < 1.0:
            raise ValueError(f"{cls.__name__}.min_factor={cls.min_factor!r} must be in (0, 1) (default 0.01)")

    def candidate_errors(self) -> tuple[Tensor, Tensor]:
        """Return ``(factors (F,), errors (R, F))``: the expected squared error of every candidate range."""
        hist = self.histogram
        device = hist.counts.device
        factors = torch.linspace(self.min_factor, 1.0, self.num_candidates, dtype=torch.float64, device=device)
        observed = torch.isfinite(hist.row_min)
        lo = torch.where(observed, hist.row_min, torch.zeros_like(hist.row_min))
        hi = torch.where(observed, hist.row_max, torch.zeros_like(hist.row_max))
        width = hist.bin_width().unsqueeze(1)
        centres = torch.minimum(torch.maximum(hist.bin_left_edges() + width / 2, lo.unsqueeze(1)), hi.unsqueeze(1))
        counts = hist.counts.double()

        num_rows = hist.num_rows
        errors = torch.empty(num_rows, self.num_candidates, dtype=torch.float64, device=device)
        occupied_cols = int((hist.counts > 0).any(dim=0).sum())
        step = max(1, _CHUNK_ELEMENTS // max(1, self.num_candidates * occupied_cols))
        for start in range(0, num_rows, step):  # chunks of rows, bounded memory
            rows = slice(start, start + step)
            cols = (hist.counts[rows] > 0).any(dim=0)
            x = centres[rows][:, cols].unsqueeze(1)  # (r, 1, b)
            c = counts[rows][:, cols].unsqueeze(1)
            cand_lo = lo[rows].unsqueeze(1) * factors  # (r, F)
            cand_hi = hi[rows].unsqueeze(1) * factors
            qp = compute_qparams(cand_lo.float(), cand_hi.float(), self.dtype_info, self.qscheme)
            zp = None if qp.zero_point is None else qp.zero_point.unsqueeze(2)
            fq = fake_quantize_values(x, qp.scale.unsqueeze(2), zp, self.dtype_info, self.qscheme)
            errors[rows] = (c * (x - fq) ** 2).sum(dim=2)
        return factors, errors

    def _rows_range(self, hist: RowHistogram) -> tuple[Tensor, Tensor]:
        factors, errors = self.candidate_errors()
        best = factors[errors.argmin(dim=1)]
        return hist.row_min * best, hist.row_max * best
