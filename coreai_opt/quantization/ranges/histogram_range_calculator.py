"""The shared base of the histogram range calculators (``percentile``, ``mse``, ``entropy``).

A calculator keeps one :class:`~coreai_opt.quantization.ranges.histogram.RowHistogram` over the rows view of
the observed tensor (the exact, mergeable statistics) and turns it into per-row ranges; subclasses choose how
(:meth:`HistogramRangeCalculatorBase._rows_range`). The error-minimising searches (mse, entropy) derive from
:class:`FormatSearchRangeCalculatorBase`, which also knows the dtype and scheme they optimise for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.collectives import agree_shape
from coreai_opt.quantization.ranges.histogram import RowHistogram
from coreai_opt.quantization.ranges.range_calculator import RangeCalculatorBase
from coreai_opt.quantization.spec.dtypes import QuantDtype, get_dtype_info
from coreai_opt.quantization.spec.granularity import Granularity, QuantizationScheme

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["FormatSearchRangeCalculatorBase", "HistogramRangeCalculatorBase"]


class HistogramRangeCalculatorBase(RangeCalculatorBase):
    """Shared machinery of the histogram range calculators (``percentile``, ``mse``, ``entropy``).

    Keeps one :class:`RowHistogram` (submodule ``histogram``) over the rows view, plus the buffer
    ``qparam_shape`` (int64, the qparam shape of the observed tensor). Subclasses implement
    :meth:`_rows_range`, which turns the histogram into per-row ``(min, max)``.

    Both ends are clamped into the row's exact observed ``[min, max]``.
    Rows that never saw a finite value report ``(+inf, -inf)`` (``compute_qparams`` treats those as 0),
    like :class:`~coreai_opt.quantization.ranges.range_calculator.MinMaxRangeCalculator`.

    Args:
        granularity: How elements are grouped into qparams.
        num_bins: Histogram bins per row, a power of two ``>= 16``.
    """

    accumulates: ClassVar[bool] = True

    def __init__(self, granularity: Granularity | None = None, *, num_bins: int = 2048) -> None:
        super().__init__(granularity)
        self.histogram = RowHistogram(num_bins)
        self.register_buffer("qparam_shape", torch.zeros(0, dtype=torch.int64))
        self._shape_known = False

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> HistogramRangeCalculatorBase:  # noqa: D102
        return cls(spec.granularity, num_bins=spec.num_bins)

    @property
    def num_bins(self) -> int:
        """Bins per row."""
        return self.histogram.num_bins

    # ------------------------------------------------------------------------------------------- contract
    def update(self, x: Tensor) -> None:
        """Add the finite values of ``x`` to the per-row histograms (NaN/Inf ignored, one warning).

        An empty ``x`` adds nothing and fixes no qparam shape.
        """
        if x.numel() == 0:
            return
        x = x.detach()
        shape = torch.tensor(self.granularity.qparam_shape(x.shape), dtype=torch.int64, device=x.device)
        if self._shape_known and not torch.equal(shape.cpu(), self.qparam_shape.cpu()):
            raise ValueError(
                f"{self.name}: observed a tensor with qparam shape {tuple(shape.tolist())} after "
                f"{tuple(self.qparam_shape.tolist())}; call reset() before observing a differently shaped tensor"
            )
        if self.histogram.update(self.granularity.to_rows(x)):
            self._warn_non_finite()
        if not self._shape_known:
            self.qparam_shape = shape
            self._shape_known = True

    def compute_range(self) -> tuple[Tensor, Tensor]:
        """Return float32 ``(min_val, max_val)`` with the qparam shape."""
        if not self.has_statistics:
            raise RuntimeError(f"{self.name}: no finite value observed yet; call update() (calibrate) first")
        hist = self.histogram
        observed = torch.isfinite(hist.row_min)
        lo, hi = self._rows_range(hist)
        # Clamp both ends into the exact observed [min, max] (a constant row gives exactly (c, c)).
        lo = torch.where(observed, torch.minimum(torch.maximum(lo, hist.row_min), hist.row_max), hist.row_min)
        hi = torch.where(observed, torch.minimum(torch.maximum(hi, hist.row_min), hist.row_max), hist.row_max)
        shape = tuple(int(d) for d in self.qparam_shape.tolist())
        return lo.float().reshape(shape), hi.float().reshape(shape)

    def _rows_range(self, hist: RowHistogram) -> tuple[Tensor, Tensor]:
        """Per-row float64 ``(min, max)`` from the histogram (rows without data may return anything)."""
        raise NotImplementedError

    def reset(self) -> None:  # noqa: D102
        self.histogram.reset()
        self.qparam_shape = torch.zeros(0, dtype=torch.int64, device=self.qparam_shape.device)
        self._shape_known = False

    @property
    def has_statistics(self) -> bool:  # noqa: D102
        return self.histogram.has_statistics

    def merge_(self, other: HistogramRangeCalculatorBase) -> HistogramRangeCalculatorBase:
        """Add another calculator's statistics (e.g. from another data shard) into this one, exactly."""
        if other._shape_known and self._shape_known and not torch.equal(self.qparam_shape, other.qparam_shape):
            raise ValueError(
                f"{self.name}: cannot merge statistics of qparam shape {tuple(other.qparam_shape.tolist())} into "
                f"{tuple(self.qparam_shape.tolist())}"
            )
        self.histogram.merge_(other.histogram)
        if other._shape_known and not self._shape_known:
            self.qparam_shape = other.qparam_shape.clone()
            self._shape_known = True
        return self

    def all_reduce(self, group: object | None = None) -> None:
        """Merge statistics across the ranks of ``group``, exactly (see :meth:`RowHistogram.all_reduce`).

        The qparam shape is agreed first; a rank that saw no data adopts it and contributes an empty
        histogram, so every rank ends with the histogram of all data. Nothing changes when no rank saw data.

        Raises:
            ValueError: on every rank, when ranks observed different qparam shapes.
        """
        local = tuple(int(d) for d in self.qparam_shape.tolist()) if self._shape_known else None
        shape = agree_shape(local, group, what=self.name)
        if shape is not None and not self._shape_known:
            self.qparam_shape = torch.tensor(shape, dtype=torch.int64, device=self.qparam_shape.device)
            self._shape_known = True
        self.histogram.all_reduce(group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # noqa: D102, ANN001
        key = prefix + "qparam_shape"
        if key in state_dict:
            self.qparam_shape = torch.empty_like(state_dict[key], device=self.qparam_shape.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        counts = state_dict.get(prefix + "histogram.counts")
        self._shape_known = counts is not None and counts.dim() == 2 and counts.shape[0] > 0


class FormatSearchRangeCalculatorBase(HistogramRangeCalculatorBase):
    """A histogram range searched for the error of one quantized format (``mse``, ``entropy``).

    Args:
        granularity: How elements are grouped into qparams.
        num_bins: Histogram bins per row (power of two ``>= 16``).
        dtype: Quantized dtype the error is measured for (name, torch dtype or ``QuantDtype``).
        qscheme: Quantization scheme the error is measured for.

    Raises:
        ValueError: unknown dtype, or a float8 dtype with an asymmetric scheme.
    """

    def __init__(
        self,
        granularity: Granularity | None = None,
        *,
        num_bins: int = 2048,
        dtype: str | torch.dtype | QuantDtype = "int8",
        qscheme: QuantizationScheme | str = QuantizationScheme.SYMMETRIC,
    ) -> None:
        super().__init__(granularity, num_bins=num_bins)
        info = dtype if isinstance(dtype, QuantDtype) else get_dtype_info(dtype)
        scheme = QuantizationScheme(qscheme)
        if info.is_float and scheme is QuantizationScheme.ASYMMETRIC:
            raise ValueError(f"dtype {info.name!r} is a float format; use qscheme='symmetric'")
        self.dtype_info, self.qscheme = info, scheme

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> FormatSearchRangeCalculatorBase:  # noqa: D102
        return cls(spec.granularity, num_bins=spec.num_bins, dtype=spec.dtype_info, qscheme=spec.qscheme)
