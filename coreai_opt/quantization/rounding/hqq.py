"""``hqq``: data-free half-quadratic optimisation of the zero point, finished with integer zero points.

HQQ (Badri & Shaji, 2023) minimises the robust error ``‖w − ŵ‖_p^p`` (``p < 1``) of each qparam group by
splitting it with an auxiliary residual ``e`` (half-quadratic splitting) and alternating, from the min/max
qparams (``z`` a float during the loop):

1. ``q = clamp(round(w / s + z), qmin, qmax)``, ``ŵ = (q − z)·s``;
2. ``e = shrink_p(w − ŵ, β)`` with the generalised soft threshold
   ``shrink_p(x, β) = sign(x)·max(|x| − |x|^(p−1) / β, 0)``;
3. asymmetric: ``z = mean_j(q_j − (w_j − e_j) / s)``; symmetric (``z`` fixed): ``s = Σ (w − e)(q − z) / Σ (q − z)²``;
4. ``β ← κ·β``.

The zero point with the smallest squared error is kept and **rounded to an integer** (onnxruntime's fast
MatMulNBits path needs integer zero points; HQQ's float zero points take its slow path), then the scale is
refit by least squares for those integers (``s ← Σ w (q − z) / Σ (q − z)²; q ← round(w / s) + z``,
:attr:`HQQRounding.refinements` rounds). Each group finally keeps the better, in squared error, of this result
and round-to-nearest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.rounding import rounding_math as rm
from coreai_opt.quantization.rounding.weight_rounding import WEIGHT_ROUNDING, WeightRoundingBase, rows_result
from coreai_opt.quantization.spec.granularity import QuantizationScheme

if TYPE_CHECKING:
    from coreai_opt.quantization.rounding.input_statistics import InputStatistics
    from coreai_opt.quantization.rounding.weight_rounding import RoundedWeight

__all__ = ["HQQRounding", "shrink_lp"]


def shrink_lp(x: Tensor, beta: float, p: float) -> Tensor:
    """``sign(x)·max(|x| − |x|^(p−1) / β, 0)`` (0 where ``x = 0``)."""
    ax = x.abs()
    return torch.sign(x) * torch.relu(ax - ax.clamp(min=1e-30).pow(p - 1.0) / beta)


@WEIGHT_ROUNDING.register("hqq")
class HQQRounding(WeightRoundingBase):
    """HQQ-style optimiser with integer zero points (module docstring). Data-free.

    Class attributes (subclass and register to change them): ``iterations``, ``p``, ``beta``, ``kappa``,
    ``refinements`` (least-squares scale rounds after rounding the zero point).
    """

    iterations: ClassVar[int] = 20
    p: ClassVar[float] = 0.7
    beta: ClassVar[float] = 10.0
    kappa: ClassVar[float] = 1.01
    refinements: ClassVar[int] = 4

    def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:  # noqa: D102
        granularity = self.spec.granularity
        rows = granularity.to_rows(weight)
        q, s, z = self.optimise_rows(rows)
        return rows_result(q, s, z, weight, granularity)

    def optimise_rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, scale, zero_point)`` per row (see the module docstring)."""
        spec = self.spec
        qmin, qmax = int(spec.quant_min), int(spec.quant_max)
        asymmetric = QuantizationScheme(spec.qscheme) is QuantizationScheme.ASYMMETRIC
        rtn_s, rtn_z = rm.rtn_qparams(rows, spec.dtype_info, spec.qscheme)
        rtn_q, rtn_err = rm.quantized_rows_error(rows, rtn_s, rtn_z, qmin, qmax, None)
        s, z = rtn_s.clone(), rtn_z.float()
        best_err, best_s, best_z = rtn_err, s.clone(), z.clone()
        beta = self.beta
        for _ in range(self.iterations):
            q = torch.clamp(torch.round(rows / s[:, None] + z[:, None]), qmin, qmax)
            approx = (q - z[:, None]) * s[:, None]
            e = shrink_lp(rows - approx, beta, self.p)
            if asymmetric:
                z = (q - (rows - e) / s[:, None]).mean(dim=1)
            else:
                s = rm.least_squares_scale(rows - e, q, z, None)
            q = torch.clamp(torch.round(rows / s[:, None] + z[:, None]), qmin, qmax)
            err = rm.row_error(rows, (q - z[:, None]) * s[:, None], None)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
            beta *= self.kappa
        z_int = torch.clamp(torch.round(best_z), qmin, qmax).to(torch.int32)
        s = best_s
        q = rm.quantize_rows(rows, s, z_int, qmin, qmax)
        for _ in range(self.refinements):
            s = rm.least_squares_scale(rows, q, z_int, None)
            q = rm.quantize_rows(rows, s, z_int, qmin, qmax)
        best = rm.BestRows(rtn_err, rtn_q, rtn_s, rtn_z)
        best.offer(rm.row_error(rows, rm.dequantize_rows(q, s, z_int), None), q, s, z_int)
        return best.result()
