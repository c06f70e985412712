"""``gptq``: GPTQ (Frantar et al., 2022) on one linear weight ``W`` ``[out, in]`` from its input Hessian.

With ``H = 2·XᵀX / n`` of the layer input (accumulated during calibration by
:class:`~coreai_opt.quantization.rounding.input_statistics.InputStatistics`), the columns of ``W`` are rounded one
after the other; the error of column ``i`` is spread over the columns not yet rounded so that the layer output
error ``‖X Wᵀ − X Ŵᵀ‖²`` stays small:

1. dead inputs (``H_jj = 0``) get ``H_jj = 1`` (their column is rounded without compensation); optional
   activation order permutes the columns by decreasing ``H_jj``;
2. damping ``H ← H + λ·mean(diag H)·I`` (``λ`` = :attr:`GPTQRounding.damping`);
3. ``U`` = upper Cholesky factor of ``H⁻¹`` (float64);
4. for each column ``i``: ``q_i = clamp(round(w_i / s_i) + z_i)``, ``ε = (w_i − (q_i − z_i)·s_i) / U_ii``,
   ``w_j ← w_j − ε·U_ij`` for ``j > i``. Updates inside a lazy block of :attr:`GPTQRounding.lazy_block` columns
   are applied at once to the later blocks (``W[:, later] −= E·U[block, later]``): the result is identical, only
   faster.

Scales follow the spec's granularity: per-block (axis 1) qparams of a block are computed, by the round-to-nearest
rule of the spec (full signed range for symmetric), from the *updated* weights when the block's first column is
reached; with activation order, per-channel or per-tensor granularity they come from the original weight
(static groups, so that a permutation never splits a block). Memory: ``W``, ``H`` and ``U`` of this one layer
(in ``commit`` ``H`` is the statistics' own ``XᵀX`` scaled in place, ``U`` computed in place in one float64 matrix
on its column-major view, where LAPACK copies nothing; ``H`` and the float64 ``U`` are released before the
weight-sized column loop, whose lazy-block update runs on row chunks and whose integers are int8).
Deterministic (no random numbers; fixed-order float arithmetic).

A linear weight rounded before calibration brought its Hessian (``prepare``) gets a provisional
round-to-nearest result (``awaiting_data``: ``convert`` refuses it until calibration replaces it). Weights that
never get a Hessian (no linear input edge: convolutions, embeddings) are rounded by the data-free clip
search of :class:`~coreai_opt.quantization.rounding.mse_clip_search.MSERounding` (for an embedding table the weight
error *is* the output error, and the search never ends above round-to-nearest).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.mse_clip_search import MSERounding, search_rows
from coreai_opt.quantization.rounding.rounding_math import rtn_qparams
from coreai_opt.quantization.rounding.weight_rounding import WEIGHT_ROUNDING, RoundedWeight, RTNRounding
from coreai_opt.quantization.spec.granularity import PerBlock, PerChannel, PerTensor

__all__ = ["GPTQRounding", "GPTQClipSearchRounding", "inverse_hessian_factor"]

#: Elements of the lazy-block update ``W[:, later] −= E·U[block, later]`` computed at a time.
_UPDATE_CHUNK = 1 << 22


def inverse_hessian_factor(hessian: Tensor, damping: float) -> Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λ·mean(diag H)·I)⁻¹`` in float64 (dead inputs get ``H_jj = 1``).

    Raises:
        ValueError: the damped Hessian is not positive definite (names the fix).
    """
    h = hessian.to(torch.float64, copy=True)
    diag = h.diagonal()
    dead = diag == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damping * float(h.diagonal().mean()))
    # In place, on the column-major view of the symmetric matrix (LAPACK's own layout, so no op copies it: one
    # d x d float64 matrix in all instead of two at each step); the same values. The result is column-major.
    f = h.mT
    info = torch.empty((), dtype=torch.int32, device=h.device)
    torch.linalg.cholesky_ex(f, out=(f, info))
    if int(info) != 0:
        raise ValueError(f"the damped Hessian is not positive definite (damping={damping}); increase damping")
    torch.cholesky_inverse(f, out=f)
    torch.linalg.cholesky(f, upper=True, out=f)
    return f


@WEIGHT_ROUNDING.register("gptq")
class GPTQRounding(MSERounding):
    """GPTQ for linear weights (module docstring); the data-free clip search for weights without input statistics.

    Class attributes (subclass and register to change them):
        damping: ``λ``, fraction of the mean Hessian diagonal added to the diagonal (0.01).
        lazy_block: Columns per lazy batch update (rounded to a multiple of the qparam block).
        act_order: Round columns by decreasing ``H_jj`` (static groups).
        clip_search: Choose each block's qparams by the weighted clip search of
            :mod:`~coreai_opt.quantization.rounding.mse_clip_search` (weights ``h_j = H_jj``) instead of
            round-to-nearest
            of its range (key ``"gptq_mse"``).
    """

    statistics_kind: ClassVar[str | None] = "hessian"
    damping: ClassVar[float] = 0.01
    lazy_block: ClassVar[int] = 128
    act_order: ClassVar[bool] = False
    clip_search: ClassVar[bool] = False

    def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:  # noqa: D102
        if statistics is None and self.statistics is not None and self.statistics.attached:
            # A linear whose Hessian calibration will bring: this result is provisional (awaiting_data, refused by
            # convert) and replaced, so round to nearest instead of running the minutes-long clip search.
            return RTNRounding.round_weight(self, weight, None)
        if statistics is None or weight.dim() != 2 or statistics.num_channels != weight.shape[1]:
            return super().round_weight(weight, statistics)
        granularity = self.spec.granularity
        out, n = weight.shape
        if isinstance(granularity, PerBlock) and granularity.axis % 2 == 1:
            block = granularity.block_size
        elif isinstance(granularity, PerChannel) and granularity.axis % 2 == 0 or isinstance(granularity, PerTensor):
            block = n
        else:
            raise ValueError(
                f"{self.name}: gptq rounds per-block (axis 1), per-channel (axis 0) or per-tensor weights, got "
                f"{granularity}; use weight_rounding='rtn' or 'mse' for it"
            )
        hessian = statistics.hessian_matrix()  # in commit: the statistics' own d x d buffer, scaled in place
        perm = torch.argsort(hessian.diagonal(), descending=True, stable=True) if self.act_order else None
        static = perm is not None or block == n
        self._diag = hessian.diagonal().clone()
        if perm is not None:
            hessian = hessian[perm][:, perm]
        factor = inverse_hessian_factor(hessian, self.damping)
        del hessian  # d x d: only the factor is needed from here on (the diagonal is kept)
        # row-major float32 (the layout the column loop's products were always computed in); the float64 factor
        # is freed here, before the weight-sized work below
        factor = torch.empty(factor.shape, device=factor.device).copy_(factor)
        w = weight.clone()
        scale, zero = self._static_qparams(weight, block) if static else (
            torch.empty(out, n // block, device=w.device), torch.empty(out, n // block, dtype=torch.int32))
        if perm is not None:
            w = w[:, perm]
        group_of = torch.arange(n, device=w.device) // block
        if perm is not None:
            group_of = group_of[perm]
        q = self._solve(w, factor, scale, zero, group_of, block, static)
        del w, factor  # before the int32 result below
        if perm is not None:
            restored = torch.empty_like(q)
            restored[:, perm] = q
            q = restored
        return RoundedWeight(q.to(torch.int32), *self._qparam_shaped(scale, zero, weight))

    def _group_qparams(self, rows: Tensor, columns: slice | None) -> tuple[Tensor, Tensor]:
        """Qparams per row of ``rows`` (``(R, B)``): round-to-nearest, or the clip search weighted by ``H_jj``."""
        if not self.clip_search:
            return rtn_qparams(rows, self.spec.dtype_info, self.spec.qscheme)
        importance = None
        if columns is not None:
            importance = self._diag[columns].float().reshape(1, -1).expand_as(rows)
        _, s, z = search_rows(rows, importance, self.spec, MSERounding.grid, MSERounding.refinements)
        return s, z

    def _static_qparams(self, weight: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """``(out, groups)`` qparams from the original weight (whole tensor for per-tensor)."""
        if isinstance(self.spec.granularity, PerTensor):
            s, z = self._group_qparams(weight.reshape(1, -1), None)
            return s.expand(weight.shape[0], 1).clone(), z.expand(weight.shape[0], 1).clone()
        out, n = weight.shape
        if block == n:
            s, z = self._group_qparams(weight, slice(0, n))
            return s.reshape(out, 1), z.reshape(out, 1)
        s, z = rtn_qparams(weight.reshape(out * (n // block), block), self.spec.dtype_info, self.spec.qscheme)
        return s.reshape(out, n // block), z.reshape(out, n // block)

    def _solve(self, w: Tensor, factor: Tensor, scale: Tensor, zero: Tensor, group_of: Tensor, block: int,
               static: bool) -> Tensor:
        """The GPTQ column loop with lazy batch updates; fills ``scale``/``zero`` for sequential groups."""
        out, n = w.shape
        qmin, qmax = int(self.spec.quant_min), int(self.spec.quant_max)
        lazy = max(block, (self.lazy_block // block) * block) if not static else self.lazy_block
        q_all = torch.empty(w.shape, dtype=torch.int8, device=w.device)  # integers of at most 8 bits: exact
        for i1 in range(0, n, lazy):
            i2 = min(i1 + lazy, n)
            w1 = w[:, i1:i2].clone()
            err1 = torch.zeros_like(w1)
            u1 = factor[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                g = int(group_of[col])
                if not static and col % block == 0:
                    s_new, z_new = self._group_qparams(w1[:, i:i + block], slice(col, col + block))
                    scale[:, g], zero[:, g] = s_new, z_new
                s, z = scale[:, g], zero[:, g].float()
                wc = w1[:, i]
                qc = torch.clamp(torch.round(wc / s) + z, qmin, qmax)
                q_all[:, col] = qc
                e = (wc - (qc - z) * s) / u1[i, i]
                w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
                err1[:, i] = e
            later = factor[i1:i2, i2:]
            # in row chunks of about _UPDATE_CHUNK elements (rows are independent; the same products, bit for
            # bit): no weight-sized product temporary
            parts = min(out, max(1, out * later.shape[1] // _UPDATE_CHUNK))  # equal parts: none tiny
            for p in range(parts):
                r = slice(out * p // parts, out * (p + 1) // parts)
                w[r, i2:] -= err1[r] @ later
        return q_all

    def _qparam_shaped(self, scale: Tensor, zero: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        granularity = self.spec.granularity
        if isinstance(granularity, PerTensor):
            return scale[0, 0].clone(), zero[0, 0].clone()
        if isinstance(granularity, PerChannel):
            return scale[:, 0].contiguous(), zero[:, 0].contiguous()
        return scale.contiguous(), zero.contiguous()


@WEIGHT_ROUNDING.register("gptq_mse")
class GPTQClipSearchRounding(GPTQRounding):
    """GPTQ whose block qparams come from the clip search weighted by the Hessian diagonal (``clip_search``)."""

    clip_search: ClassVar[bool] = True
