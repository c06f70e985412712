"""Bounded-memory, exactly mergeable histograms for the percentile / mse / entropy range calculators.

:class:`RowHistogram` is the histogram (its grid, growth, merging, all-reduce); the calculators' shared base,
which turns a histogram into ranges, is
:class:`~coreai_opt.quantization.ranges.histogram_range_calculator.HistogramRangeCalculatorBase`.

The grid
--------
Row ``r`` of a :class:`RowHistogram` covers the symmetric power-of-two range ``[-2^k_r, 2^k_r)`` with
``B = num_bins`` bins (``B`` a power of two) of width ``w_r = 2^(k_r + 1) / B``. A finite value ``x`` goes to

    ``bin(x) = floor(x / w_r) + B / 2``.

Because ``w_r`` is a power of two, ``x / w_r`` is exact (it only shifts the exponent), so the bin of a value
depends on the value and on ``k_r`` only. The exponent is the smallest one that holds every finite value
observed in the row, ``k_r = max(K_FLOOR, min{k : max|x| < 2^k})``; it is a function of the data, not of
the order the data came in.

Growing the grid
----------------
When a batch needs a larger exponent ``k' = k + d``, every old bin ``i`` moves to
``floor((i - B/2) / 2^d) + B/2``: on the coarser grid ``floor(x / (2^d w)) = floor(floor(x / w) / 2^d)``,
so the move is *exact*, i.e. the histogram after growing equals the histogram the data would have had if it
had been binned on the coarse grid from the start. Hence, for any sequence or partition of batches,

    ``histogram(batch_1, ..., batch_n) == histogram(concat(batch_1, ..., batch_n))``  (bit for bit),

which is what makes data-parallel calibration (:meth:`RowHistogram.all_reduce`) give exactly the
single-process result. Counts are int64, so sums are exact too.

Memory is ``R × B`` int64 counts plus four length-``R`` vectors, fixed after the first batch: it does not
grow with the number of batches. ``R × B`` above :data:`MAX_HISTOGRAM_ENTRIES` is refused with a
``ValueError`` (per-channel / per-block histograms of large tensors).

Values below ``2^K_FLOOR`` in magnitude (``K_FLOOR = -100``, about ``7.9e-31``) share the grid of
``2^K_FLOOR``; they still count, and the exact per-row min/max keep their true values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from coreai_opt.quantization.collectives import agree_shape, all_reduce
from coreai_opt.quantization.ranges.range_calculator import finite_rows_min_max
from coreai_opt.quantization.spec.num_bins import check_num_bins

__all__ = [
    "RowHistogram",
    "MAX_HISTOGRAM_ENTRIES",
    "K_FLOOR",
]

#: Largest ``rows × num_bins`` a histogram may hold (2^24 int64 counts = 128 MiB).
MAX_HISTOGRAM_ENTRIES: int = 2**24

#: Smallest grid exponent: every row covers at least ``[-2^K_FLOOR, 2^K_FLOOR)``.
K_FLOOR: int = -100

def _rebin_indices(num_bins: int, shift: Tensor) -> Tensor:
    """Destination bin of every bin when row ``r`` grows its exponent by ``shift[r] >= 0``.

    ``dst[r, i] = floor((i - B/2) / 2^shift[r]) + B/2``. Shifts beyond ``log2(B)`` are clamped: every bin
    then lands in ``B/2 - 1`` (negative values) or ``B/2`` (non-negative values) either way.
    """
    half = num_bins // 2
    shift = shift.clamp(min=0, max=int(math.log2(num_bins)))
    src = torch.arange(num_bins, device=shift.device, dtype=torch.int64) - half
    divisor = torch.pow(2, shift).to(torch.int64).unsqueeze(1)
    return torch.div(src.unsqueeze(0), divisor, rounding_mode="floor") + half


class RowHistogram(nn.Module):
    """Histogram of every row of a rows view on an exactly mergeable power-of-two grid (see module docs).

    Buffers (the row count ``R`` is taken from the first tensor):

    * ``counts``: ``(R, num_bins)`` int64.
    * ``exponent``: ``(R,)`` int64, the ``k_r`` of each row's range ``[-2^k_r, 2^k_r)``.
    * ``row_min`` / ``row_max``: ``(R,)`` float64 exact min / max of the finite values (``+inf`` / ``-inf``
      for a row that has seen none).

    Args:
        num_bins: Bins per row, a power of two ``>= 16``.
    """

    def __init__(self, num_bins: int = 2048) -> None:
        super().__init__()
        self.num_bins = check_num_bins(num_bins)
        self.register_buffer("counts", torch.zeros(0, num_bins, dtype=torch.int64))
        self.register_buffer("exponent", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("row_min", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("row_max", torch.zeros(0, dtype=torch.float64))

    # ------------------------------------------------------------------------------------------- state
    @property
    def num_rows(self) -> int:
        """Row count ``R`` (0 before the first update)."""
        return self.counts.shape[0]

    @property
    def has_statistics(self) -> bool:
        """True once at least one finite value was counted."""
        return self.num_rows > 0 and bool(torch.isfinite(self.row_min).any())

    def reset(self) -> None:
        """Forget everything, including the row count."""
        self._allocate(0, self.counts.device)

    def _allocate(self, rows: int, device: torch.device) -> None:
        self.counts = torch.zeros(rows, self.num_bins, dtype=torch.int64, device=device)
        self.exponent = torch.full((rows,), K_FLOOR, dtype=torch.int64, device=device)
        self.row_min = torch.full((rows,), math.inf, dtype=torch.float64, device=device)
        self.row_max = torch.full((rows,), -math.inf, dtype=torch.float64, device=device)

    def _ensure_rows(self, rows: int, device: torch.device) -> None:
        if self.num_rows == rows:
            return
        if self.num_rows != 0:
            raise ValueError(
                f"histogram holds {self.num_rows} rows but the new tensor has {rows} qparam groups; a calculator "
                "observes one tensor shape; call reset() before observing a differently shaped tensor"
            )
        if rows * self.num_bins > MAX_HISTOGRAM_ENTRIES:
            mib = rows * self.num_bins * 8 / 2**20
            raise ValueError(
                f"a histogram of {rows} rows x {self.num_bins} bins ({mib:.0f} MiB) exceeds the cap of "
                f"{MAX_HISTOGRAM_ENTRIES} counts; use per-tensor granularity, fewer bins, or "
                "range_calculator='minmax' for this quantizer"
            )
        self._allocate(rows, device)

    # ------------------------------------------------------------------------------------------- grid
    def bin_width(self) -> Tensor:
        """Per-row bin width ``w_r = 2^(k_r + 1) / B`` (float64, ``(R,)``)."""
        return torch.ldexp(torch.ones_like(self.row_min), self.exponent + 1 - int(math.log2(self.num_bins)))

    def bin_left_edges(self) -> Tensor:
        """Left edge of every bin, ``(i - B/2) · w_r`` (float64, ``(R, B)``)."""
        offsets = torch.arange(self.num_bins, dtype=torch.float64, device=self.counts.device) - self.num_bins // 2
        return offsets.unsqueeze(0) * self.bin_width().unsqueeze(1)

    def abs_counts(self) -> Tensor:
        """Histogram of ``|x|``: ``(R, B/2)`` int64 whose bin ``i`` covers ``[i·w_r, (i+1)·w_r)``.

        Positive bin ``B/2 + i`` and its mirror ``B/2 - 1 - i`` fold together.
        """
        half = self.num_bins // 2
        return self.counts[:, half:] + self.counts[:, :half].flip(1)

    def _grow_to(self, new_exponent: Tensor) -> None:
        """Move every row onto the grid of ``new_exponent >= exponent`` (exact bin-pair merging)."""
        shift = new_exponent - self.exponent
        if bool((shift > 0).any()):
            dst = _rebin_indices(self.num_bins, shift)
            self.counts = torch.zeros_like(self.counts).scatter_add_(1, dst, self.counts)
        self.exponent = new_exponent

    # ------------------------------------------------------------------------------------------- update
    def update(self, rows: Tensor) -> bool:
        """Count the finite values of a ``(R, N)`` rows view.

        Args:
            rows: Rows view (see :mod:`~coreai_opt.quantization.spec.granularity`), any float dtype.

        Returns:
            True when ``rows`` contained NaN or Inf (those values are not counted).
        """
        if rows.dim() != 2:
            raise ValueError(f"RowHistogram.update expects a 2-D rows view (R, N), got shape {tuple(rows.shape)}")
        rows = rows.detach()
        if not rows.is_floating_point():
            rows = rows.float()
        num_rows = rows.shape[0]
        self._ensure_rows(num_rows, rows.device)
        if rows.shape[1] == 0:
            return False
        mn, mx, had_non_finite = finite_rows_min_max(rows)

        # Smallest k with max|x| < 2^k: frexp gives max|x| = m·2^e, m in [0.5, 1), hence k = e.
        max_abs = torch.maximum(-mn, mx).double()
        valid = torch.isfinite(max_abs) & (max_abs > 0)
        _, exp = torch.frexp(torch.where(valid, max_abs, torch.ones_like(max_abs)))
        batch_k = torch.where(valid, exp.to(torch.int64), torch.full_like(self.exponent, K_FLOOR))
        self._grow_to(torch.maximum(self.exponent, batch_k.clamp(min=K_FLOOR)))

        # Bin index floor(x / w) + B/2, computed as x · 2^(log2 B - 1 - k): exact power-of-two scaling.
        # The flat index r·B + bin stays below 2^24 (the size cap), so float32 holds it exactly; every step
        # after the product works in place to keep large activations cheap.
        log2_bins = int(math.log2(self.num_bins))
        k_max = int(self.exponent.max())
        compute_dtype = torch.float64 if rows.dtype == torch.float64 or k_max > 100 else torch.float32
        x = rows.to(compute_dtype)
        if had_non_finite:
            finite = torch.isfinite(x)
            x = torch.where(finite, x, torch.zeros_like(x))
        inv_width = torch.ldexp(
            torch.ones(num_rows, 1, dtype=compute_dtype, device=x.device), log2_bins - 1 - self.exponent.unsqueeze(1)
        )
        flat = torch.mul(x, inv_width).floor_()
        if k_max > log2_bins:
            # w > 2: x · 2^-e can underflow to -0.0 for a subnormal negative x; it belongs left of zero.
            flat = torch.where((x < 0) & (flat >= 0), torch.full_like(flat, -1.0), flat)
        offsets = torch.arange(num_rows, device=x.device, dtype=compute_dtype).unsqueeze(1) * self.num_bins
        flat.add_(offsets + self.num_bins // 2)
        flat = flat[finite] if had_non_finite else flat.reshape(-1)
        binned = torch.bincount(flat.to(torch.int32), minlength=num_rows * self.num_bins)
        self.counts += binned.view(num_rows, self.num_bins)

        self.row_min = torch.minimum(self.row_min, mn.double())
        self.row_max = torch.maximum(self.row_max, mx.double())
        return had_non_finite

    # ------------------------------------------------------------------------------------------- merging
    def merge_(self, other: RowHistogram) -> RowHistogram:
        """Add ``other``'s statistics into this histogram, exactly (aligns both grids, then sums).

        Raises:
            ValueError: different ``num_bins`` or row counts.
        """
        if other.num_bins != self.num_bins:
            raise ValueError(
                f"cannot merge histograms with {self.num_bins} and {other.num_bins} bins; build both calculators "
                "from the same spec"
            )
        if other.num_rows == 0:
            return self
        if self.num_rows == 0:
            self._allocate(other.num_rows, other.counts.device)
        if other.num_rows != self.num_rows:
            raise ValueError(
                f"cannot merge histograms of {self.num_rows} and {other.num_rows} rows; both must observe tensors "
                "with the same qparam shape"
            )
        exponent = torch.maximum(self.exponent, other.exponent)
        self._grow_to(exponent)
        theirs = other.counts
        shift = exponent - other.exponent
        if bool((shift > 0).any()):
            theirs = torch.zeros_like(theirs).scatter_add_(1, _rebin_indices(self.num_bins, shift), theirs)
        self.counts = self.counts + theirs
        self.row_min = torch.minimum(self.row_min, other.row_min)
        self.row_max = torch.maximum(self.row_max, other.row_max)
        return self

    def all_reduce(self, group: object | None = None) -> None:
        """Merge the histograms of every rank of ``group`` so that all ranks end with the same, exact result.

        ``k = MAX_r k_r``; every rank moves its counts onto the grid of ``k`` (exact), then
        ``counts = SUM_r counts_r``, ``row_min = MIN_r row_min_r``, ``row_max = MAX_r row_max_r``.

        Collectives, in order (every rank runs all of them, also a rank that saw no data):

        1. The row count ``R`` (:func:`~coreai_opt.quantization.collectives.agree_shape` of ``(R,)``);
           a rank without rows allocates ``R`` empty rows (neutral: zero counts, ``K_FLOOR``, ``±inf``).
        2. MAX of ``exponent``; each rank moves its counts onto the common grid.
        3. SUM of ``counts``; MIN of ``row_min``; MAX of ``row_max``.

        Raises:
            ValueError: on every rank, when ranks observed different row counts.
        """
        rows = self.num_rows
        agreed = agree_shape((rows,) if rows else None, group, what="RowHistogram.all_reduce")
        if agreed is None or agreed[0] == 0:
            return
        if rows == 0:
            self._allocate(agreed[0], self.counts.device)
        self._grow_to(all_reduce(self.exponent, "max", group))
        counts = all_reduce(self.counts, "sum", group)
        row_min = all_reduce(self.row_min, "min", group)
        row_max = all_reduce(self.row_max, "max", group)
        self.counts, self.row_min, self.row_max = counts, row_min, row_max

    # ------------------------------------------------------------------------------------------- loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # noqa: D102, ANN001
        # The row count is set by the first observed tensor: adopt the saved one (num_bins must match).
        key = prefix + "counts"
        if key in state_dict and state_dict[key].dim() == 2 and state_dict[key].shape[1] == self.num_bins:
            self._allocate(state_dict[key].shape[0], self.counts.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
