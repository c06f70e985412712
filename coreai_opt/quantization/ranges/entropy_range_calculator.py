"""``"entropy"`` range calculator: TensorRT-style KL-divergence calibration of a clipping threshold.

Works on the ``|x|`` histogram ``h_0 .. h_{n-1}`` of every row (``n = num_bins / 2`` bins of width ``w``; the
signed histogram folded at 0). With ``N = Σ h``, ``L`` quantization levels and a candidate threshold
``T_i = i · w`` for ``i = L .. n_used`` (``n_used`` = last non-empty bin + 1):

* reference ``P``: ``h_0 .. h_{i-1}`` with the clipped outliers ``t_i = Σ_{b ≥ i} h_b`` added to the last bin;
* quantized ``Q``: bins ``0 .. i-1`` grouped into ``L`` levels of ``m = i // L`` bins (the last level takes the
  remainder); level ``l`` holds ``S_l = Σ_{b ∈ l} h_b`` spread evenly over its ``nnz_l`` bins where ``P > 0``;
* ``KL(P ‖ Q) = Σ_b p_b log(p_b / q_b)`` with ``p = P / N``, ``q = Q / Σ_{b<i} h_b``.

Because ``Q`` is constant inside a level, the sum collapses to prefix sums (no per-bin work per candidate):

    ``KL_i = (1/N) Σ_b P_b log P_b − log N − (1/N) Σ_l P_l · log(S_l / (nnz_l · Σ_{b<i} h_b))``

with ``P_l = S_l (+ t_i for the last level)``. Smoothing: where a level of ``Q`` is empty but ``P`` has mass (only
the last level, when it holds nothing but clipped outliers) each of its bins gets probability
``Q_FLOOR = 1e-4`` (the ε of the usual KL smoothing), which keeps the divergence finite. The
threshold ``T* = i* · w`` of the smallest divergence gives the range ``(max(min, −T*), min(max, T*))``.
A row whose data fits in at most ``L`` bins keeps its observed range (quantization is already finer than the
histogram).

Levels ``L``: the ``|x|`` side of a symmetric grid has ``(qmax − qmin + 1) / 2`` levels (128 for int8,
TensorRT's choice); an ``asymmetric`` row whose data has one sign maps ``[0, T]`` onto all ``qmax − qmin + 1``
levels; float8 dtypes use ``2^(bits − 1) = 128`` (a uniform-grid approximation of a non-uniform format). When
``L`` reaches the ``|x|`` bin count the observed range is kept. The search costs ``O(rows × candidates × L)``:
4-10 ms per row for 2048 bins and int8 (one loaded CPU core), computed once per quantizer at commit time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from coreai_opt.quantization.ranges.histogram import RowHistogram
from coreai_opt.quantization.ranges.histogram_range_calculator import FormatSearchRangeCalculatorBase
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.spec.granularity import QuantizationScheme
from coreai_opt.quantization.spec.qparams_math import quant_range

if TYPE_CHECKING:
    pass

__all__ = ["EntropyRangeCalculator", "kl_divergence_per_threshold"]

_CHUNK_ELEMENTS = 2**22

#: Probability given to each bin of a quantized level that holds no mass where ``P`` has some.
Q_FLOOR: float = 1e-4


def _xlogx(x: Tensor) -> Tensor:
    return torch.where(x > 0, x * torch.log(x.clamp(min=1e-300)), torch.zeros_like(x))


def kl_divergence_per_threshold(abs_counts: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """``KL(P_i ‖ Q_i)`` for every candidate bin count ``i = levels .. n_used`` of every row (see module docs).

    With ``s_l`` the level sums, ``z_l`` their non-empty bin counts and ``S = Σ_{b<i} h_b``, the cross term is
    ``Σ_{l<L-1} [s_l log s_l − s_l log z_l] − (S − s_{L-1}) log S + P_{L-1} log q_{L-1}``, so each candidate
    costs ``O(L)`` work on gathered prefix sums.

    Args:
        abs_counts: ``(R, n)`` histogram of ``|x|``.
        levels: Quantization levels ``L`` (``1 <= L <= n``).

    Returns:
        ``(candidates (C,), kl (R, C))``: candidate bin counts ``i`` (from ``L`` to the largest ``n_used``) and
        their divergence; candidates beyond a row's own last non-empty bin are ``inf``.
    """
    h = abs_counts.double()
    num_rows, n = h.shape
    device = h.device
    zero = torch.zeros(num_rows, 1, dtype=torch.float64, device=device)
    cs = torch.cat([zero, h.cumsum(1)], dim=1)  # cs[:, j] = Σ_{b<j} h_b
    cz = torch.cat([zero, (h > 0).double().cumsum(1)], dim=1)
    cxl = torch.cat([zero, _xlogx(h).cumsum(1)], dim=1)
    total = cs[:, -1:].clamp(min=1.0)
    occupied = (h > 0).to(torch.int64) * torch.arange(1, n + 1, dtype=torch.int64, device=device)
    n_used = occupied.amax(dim=1, keepdim=True)  # last non-empty bin + 1

    candidates = torch.arange(levels, max(levels, int(n_used.max())) + 1, dtype=torch.int64, device=device)
    kl = torch.empty(num_rows, candidates.numel(), dtype=torch.float64, device=device)
    level_idx = torch.arange(levels, dtype=torch.int64, device=device)
    log_floor = math.log(Q_FLOOR)
    step = max(1, _CHUNK_ELEMENTS // max(1, num_rows * levels))

    def take(prefix: Tensor, idx: Tensor) -> Tensor:
        return prefix.gather(1, idx.reshape(1, -1).expand(num_rows, -1)).reshape(num_rows, *idx.shape)

    for start in range(0, candidates.numel(), step):  # chunks of candidates, bounded memory
        i = candidates[start : start + step]  # (C,)
        m = i // levels
        lo = level_idx.unsqueeze(0) * m.unsqueeze(1)  # (C, L) first bin of each level
        hi = torch.where(level_idx.unsqueeze(0) == levels - 1, i.unsqueeze(1), lo + m.unsqueeze(1))
        s = take(cs, hi) - take(cs, lo)  # (R, C, L)
        z = take(cz, hi) - take(cz, lo)
        cs_i = take(cs, i)  # (R, C)
        tail = total - cs_i
        h_last = cs_i - take(cs, i - 1)
        log_cs_i = torch.log(cs_i.clamp(min=1.0))
        s_in, z_in = s[..., :-1], z[..., :-1]
        inner = (_xlogx(s_in) - s_in * torch.log(z_in.clamp(min=1.0))).sum(dim=2)
        s_last = s[..., -1]
        z_last = z[..., -1] + ((h_last == 0) & (tail > 0)).double()
        log_q_last = torch.where(
            s_last > 0,
            torch.log(s_last.clamp(min=1.0)) - torch.log(z_last.clamp(min=1.0)) - log_cs_i,
            torch.full_like(s_last, log_floor),
        )
        cross = inner - (cs_i - s_last) * log_cs_i + (s_last + tail) * log_q_last
        sum_plogp = take(cxl, i) - _xlogx(h_last) + _xlogx(h_last + tail)
        kl[:, start : start + step] = (sum_plogp - cross) / total - torch.log(total)
    kl = torch.where(candidates.unsqueeze(0) > n_used, torch.full_like(kl, math.inf), kl)
    return candidates, kl


@RANGE_CALCULATORS.register("entropy")
class EntropyRangeCalculator(FormatSearchRangeCalculatorBase):
    """Symmetric clipping threshold minimising ``KL(P ‖ Q)`` on the ``|x|`` histogram (see module docs).

    Constructor arguments as :class:`FormatSearchRangeCalculatorBase` (the ``|x|`` histogram has half of
    ``num_bins``; ``dtype`` sets the number of levels; ``asymmetric`` one-sided rows use every level).
    """

    def num_levels(self, one_sided: bool) -> int:
        """Quantization levels available to ``[0, T]`` (before capping at the bin count)."""
        if self.dtype_info.is_float:
            return 2 ** (self.dtype_info.bits - 1)
        qmin, qmax = quant_range(self.dtype_info, self.qscheme)
        full = int(qmax - qmin + 1)
        if self.qscheme is QuantizationScheme.ASYMMETRIC and one_sided:
            return full
        return full // 2

    def thresholds(self) -> Tensor:
        """Per-row threshold ``T*`` (float64, ``(R,)``); ``inf`` keeps the observed range."""
        hist = self.histogram
        abs_counts = hist.abs_counts()
        n = abs_counts.shape[1]
        one_sided = (hist.row_min >= 0) | (hist.row_max <= 0)
        result = torch.full((hist.num_rows,), math.inf, dtype=torch.float64, device=abs_counts.device)
        width = hist.bin_width()
        for flag in (False, True):  # at most two level counts
            rows = one_sided == flag
            levels = self.num_levels(flag)
            if not bool(rows.any()) or levels >= n:
                continue
            candidates, kl = kl_divergence_per_threshold(abs_counts[rows], levels)
            best = candidates[kl.argmin(dim=1)].double()
            finite = torch.isfinite(kl).any(dim=1)  # rows that fit in <= L bins have no finite candidate
            result[rows] = torch.where(finite, best * width[rows], torch.full_like(best, math.inf))
        return result

    def _rows_range(self, hist: RowHistogram) -> tuple[Tensor, Tensor]:
        t = self.thresholds()
        return -t, t
