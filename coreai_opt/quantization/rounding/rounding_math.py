"""Row-level math shared by the weight-rounding algorithms (rows view: one qparam per row, see :mod:`granularity`).

Notation: ``w`` a row of ``N`` weights, ``h`` optional per-element importance (``E[x_j²]`` of the input channel
the element multiplies; 1 when absent), ``(qmin, qmax)`` the integer range, ``z`` the zero point.

* Quantize: ``q = clamp(round(w / s) + z, qmin, qmax)`` (division, round half to even: onnxruntime's rule),
  dequantize ``ŵ = (q − z)·s``.
* **Full signed range** (symmetric): with ``v`` the element of largest magnitude (keeping its sign) and
  ``z = (qmin + qmax + 1) // 2`` (0 for signed dtypes), ``s = α·v / (qmin − z)``, so ``v`` maps exactly onto
  ``qmin`` (int4: −8) and all 16 levels are used; the scale carries the sign of ``v`` (onnxruntime's and NNCF's
  ``vmax / −8``). ``α ≤ 1`` clips. A zero row gets ``s = eps``.
* Asymmetric: ``compute_qparams(α·min, α·max)`` (the range always contains 0).
* Weighted error of a row: ``e = Σ_j h_j (w_j − ŵ_j)²``.
* Least-squares scale for fixed integers: ``s* = Σ h w (q − z) / Σ h (q − z)²`` (minimises ``e`` over ``s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from coreai_opt.quantization.spec.dtypes import QuantDtype
from coreai_opt.quantization.spec.granularity import QuantizationScheme
from coreai_opt.quantization.spec.qparams_math import SCALE_EPS, compute_qparams, quant_range

__all__ = [
    "BestRows",
    "dequantize_rows",
    "least_squares_scale",
    "quantize_rows",
    "quantized_rows_error",
    "row_error",
    "rtn_qparams",
    "symmetric_zero_point",
]


def symmetric_zero_point(dtype_info: QuantDtype) -> int:
    """Zero point of the symmetric scheme: the middle of the range (0 for signed dtypes, 8 for uint4)."""
    qmin, qmax = dtype_info.quant_min, dtype_info.quant_max
    return (int(qmin) + int(qmax) + 1) // 2


def rtn_qparams(
    rows: Tensor, dtype_info: QuantDtype, qscheme: QuantizationScheme, alpha: Tensor | float = 1.0
) -> tuple[Tensor, Tensor]:
    """Per-row ``(scale, zero_point)`` of round-to-nearest: full signed range (symmetric) or min/max (asymmetric).

    Args:
        rows: ``(R, N)`` float32.
        dtype_info: Integer target dtype.
        qscheme: ``symmetric`` uses the full signed range (module docstring); ``symmetric_with_clipping`` the
            narrowed range with ``s = α·max|w| / qmax``; ``asymmetric`` ``compute_qparams``.
        alpha: Clip factor per row (``(R,)``) or scalar, ``0 < α ≤ 1``.

    Returns:
        ``scale`` float32 ``(R,)`` (negative where the largest-magnitude element is positive, symmetric only) and
        ``zero_point`` int32 ``(R,)``.
    """
    scheme = QuantizationScheme(qscheme)
    alpha = torch.as_tensor(alpha, dtype=torch.float32, device=rows.device)
    if scheme is QuantizationScheme.ASYMMETRIC:
        mn, mx = torch.aminmax(rows, dim=1)
        params = compute_qparams(mn * alpha, mx * alpha, dtype_info, scheme)
        return params.scale, params.zero_point
    qmin, qmax = quant_range(dtype_info, scheme)
    z = symmetric_zero_point(dtype_info)
    if scheme is QuantizationScheme.SYMMETRIC_WITH_CLIPPING:
        scale = torch.clamp(alpha * rows.abs().amax(dim=1) / float(qmax - z), min=SCALE_EPS)
    else:
        idx = rows.abs().argmax(dim=1, keepdim=True)
        v = rows.gather(1, idx).squeeze(1)
        scale = alpha * v / float(qmin - z)
        scale = torch.where(scale.abs() < SCALE_EPS, torch.full_like(scale, SCALE_EPS), scale)
    return scale, torch.full_like(scale, z, dtype=torch.int32)


def quantize_rows(rows: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    """``q = clamp(round(w / s) + z, qmin, qmax)`` per row (float32 result holding integers)."""
    return torch.clamp(torch.round(rows / scale[:, None]) + zero_point[:, None].float(), qmin, qmax)


def dequantize_rows(q: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
    """``ŵ = (q − z)·s`` per row."""
    return (q - zero_point[:, None].float()) * scale[:, None]


def row_error(rows: Tensor, approx: Tensor, importance: Tensor | None) -> Tensor:
    """``Σ_j h_j (w_j − ŵ_j)²`` per row (``h = 1`` when ``importance`` is None)."""
    sq = (rows - approx).square()
    return (sq if importance is None else sq * importance).sum(dim=1)


def least_squares_scale(rows: Tensor, q: Tensor, zero_point: Tensor, importance: Tensor | None) -> Tensor:
    """``s* = Σ h w (q − z) / Σ h (q − z)²`` per row; rows whose integers are all ``z`` get ``eps``."""
    centred = q - zero_point[:, None].float()
    weighted = centred if importance is None else centred * importance
    num = (weighted * rows).sum(dim=1)
    den = (weighted * centred).sum(dim=1)
    scale = num / torch.where(den > 0, den, torch.ones_like(den))
    return torch.where((den > 0) & (scale.abs() >= SCALE_EPS), scale, torch.full_like(scale, SCALE_EPS))


def quantized_rows_error(
    rows: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int, importance: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(q, e)`` for given qparams: ``q = clamp(round(w / s) + z, qmin, qmax)``, ``e = Σ_j h_j (w_j − ŵ_j)²``."""
    q = quantize_rows(rows, scale, zero_point, qmin, qmax)
    return q, row_error(rows, dequantize_rows(q, scale, zero_point), importance)


@dataclass
class BestRows:
    """Per row, the ``(q, scale, zero_point)`` with the smallest error offered so far (the first offer on ties)."""

    error: Tensor
    q: Tensor
    scale: Tensor
    zero_point: Tensor

    def offer(self, error: Tensor, q: Tensor, scale: Tensor, zero_point: Tensor) -> bool:
        """Keep, row by row, the candidate where ``error < self.error``; True when any row improved."""
        better = error < self.error
        self.error = torch.where(better, error, self.error)
        self.q = torch.where(better[:, None], q, self.q)
        self.scale = torch.where(better, scale, self.scale)
        self.zero_point = torch.where(better, zero_point, self.zero_point)
        return bool(better.any())

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, scale, zero_point)``."""
        return self.q, self.scale, self.zero_point
