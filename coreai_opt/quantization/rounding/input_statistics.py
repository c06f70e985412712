"""``InputStatistics``: what data-aware weight rounding needs to know about a linear layer's input.

A weight-rounding algorithm (:mod:`weight_rounding`) that minimises the *layer output* error
``‖X Wᵀ − X Ŵᵀ‖²`` needs statistics of the input ``X`` (rows ``x_t`` of length ``d`` = input channels),
accumulated over every calibration token ``t`` without ever holding the activations:

===================  ==================================  ==========================================
buffer               value                               used by
===================  ==================================  ==========================================
``count``            ``n = Σ_t 1`` (float64)             every statistic below is a sum; divide by n
``sum_sq``           ``Σ_t x_t²`` (per channel, ``d``)   second moments ``E[x_j²]`` (weighted MSE)
``sum_abs``          ``Σ_t |x_t|`` (``d``)               mean magnitude (activation-aware scaling)
``xtx``              ``Σ_t x_tᵀ x_t`` (``d × d``)        Hessian ``H = 2·XᵀX / n`` (GPTQ); only when
                                                         built with ``hessian=True``
``min_val/max_val``  per-channel range (``d``)           :meth:`compute_range`
===================  ==================================  ==========================================

The module is a range calculator (per input channel), so ``torch.distributed`` merges reach it like every
other free-standing range calculator: :meth:`all_reduce` SUMs the sums and the count and takes MIN / MAX of
the range; a rank without data contributes zeros / ±inf after the shapes are agreed. The graph pass
``insert_weight_statistics`` calls it on the input edge of the linear whose weight it serves; it observes only
while :attr:`enabled` (``calibrate`` switches it on for the calibration loop) and always returns its input.
Non-finite rows are skipped with one warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from coreai_opt.quantization.collectives import agree_shape, all_reduce
from coreai_opt.quantization.ranges.range_calculator import RangeCalculatorBase
from coreai_opt.quantization.spec.granularity import PerChannel

__all__ = ["InputStatistics"]

_SUMS = ("sum_sq", "sum_abs", "xtx")
_ROWS = ("rows", "row_counts")


class InputStatistics(RangeCalculatorBase):
    """Streaming first/second-moment statistics of a linear layer's input (see the module docstring).

    Args:
        hessian: Also accumulate the ``d × d`` matrix ``Σ xᵀx`` (one per linear; GPTQ needs it).

    Attributes:
        enabled: Observe in :meth:`forward` (plain bool, off by default; ``calibrate`` turns it on).
        attached: Set by the graph pass once the module is called on a linear's input edge.
    """

    count: Tensor
    sum_sq: Tensor
    sum_abs: Tensor
    xtx: Tensor
    rows: Tensor
    row_counts: Tensor

    def __init__(self, hessian: bool = False) -> None:
        super().__init__(PerChannel(-1))
        self.hessian = bool(hessian)
        self.enabled = False
        self.attached = False
        self._consume = False  # see consumed()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        for name in (*_SUMS, *_ROWS, "min_val", "max_val"):
            self.register_buffer(name, torch.empty(0))

    # --- observation ---
    def forward(self, x: Tensor) -> Tensor:
        """Observe ``x`` when :attr:`enabled`; always return ``x`` unchanged."""
        if self.enabled:
            self.update(x)
        return x

    def update(self, x: Tensor) -> None:
        """Add the rows of ``x`` (last dim = input channels) to the sums; an empty ``x`` adds nothing."""
        if x.numel() == 0:
            return
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        finite = torch.isfinite(rows).all(dim=1)
        if not bool(finite.all()):
            self._warn_non_finite()
            rows = rows[finite]
        if rows.shape[0] == 0:
            return
        d = rows.shape[1]
        if self.sum_sq.numel() == 0:
            self._allocate(d, rows.device)
        elif self.sum_sq.shape[0] != d:
            raise ValueError(f"{self.name}: input has {d} channels, earlier batches had {self.sum_sq.shape[0]}")
        self.sum_sq += rows.square().sum(dim=0)
        self.sum_abs += rows.abs().sum(dim=0)
        if self.hessian:
            self._add_rows(rows)
        mn, mx = torch.aminmax(rows, dim=0)
        torch.minimum(self.min_val, mn, out=self.min_val)
        torch.maximum(self.max_val, mx, out=self.max_val)
        self.count += rows.shape[0]

    def _add_rows(self, rows: Tensor) -> None:
        """Keep ``rows`` (``n < d``) or add their product to ``XᵀX`` (module docstring: rows before the Hessian)."""
        if self.xtx.numel():
            self.xtx.addmm_(rows.T, rows)
            return
        self.rows = torch.cat([self.rows, rows]) if self.rows.numel() else rows.clone()
        self.row_counts = torch.cat([self.row_counts, torch.tensor([rows.shape[0]], device=rows.device)])
        if self.rows.shape[0] >= self.rows.shape[1]:
            self._form_xtx()

    def _form_xtx(self) -> None:
        """``XᵀX`` from the kept rows, one product per observed batch in order (a no-op once formed)."""
        if self.xtx.numel() or not self.hessian or not self.num_channels:
            return
        d = self.num_channels
        self.xtx = torch.zeros((d, d), device=self.sum_sq.device)
        start = 0
        for count in self.row_counts.tolist():
            batch = self.rows[start:start + count]
            self.xtx.addmm_(batch.T, batch)
            start += count
        self.rows = torch.empty(0, device=self.sum_sq.device)
        self.row_counts = torch.empty(0, dtype=torch.int64, device=self.sum_sq.device)

    def _allocate(self, d: int, device: torch.device) -> None:
        self.sum_sq = torch.zeros(d, device=device)
        self.sum_abs = torch.zeros(d, device=device)
        self.xtx = torch.empty(0, device=device)  # formed from the rows (module docstring)
        self.rows = torch.empty(0, device=device)
        self.row_counts = torch.empty(0, dtype=torch.int64, device=device)
        self.min_val = torch.full((d,), float("inf"), device=device)
        self.max_val = torch.full((d,), float("-inf"), device=device)

    # --- results ---
    @property
    def has_statistics(self) -> bool:  # noqa: D102
        return float(self.count) > 0

    @property
    def num_channels(self) -> int:
        """Input channels ``d`` (0 before the first observation)."""
        return int(self.sum_sq.numel())

    def second_moment(self) -> Tensor:
        """``E[x_j²] = sum_sq / n`` per input channel.

        Raises:
            RuntimeError: nothing observed.
        """
        self._require()
        return self.sum_sq / float(self.count)

    def mean_abs(self) -> Tensor:
        """``E[|x_j|]`` per input channel."""
        self._require()
        return self.sum_abs / float(self.count)

    def hessian_matrix(self) -> Tensor:
        """``H = 2·XᵀX / n`` (``d × d``, float32).

        Raises:
            RuntimeError: nothing observed, or the module was built without ``hessian=True``.
        """
        self._require()
        if not self.hessian:
            raise RuntimeError(f"{self.name}: built with hessian=False; it has no XᵀX to return")
        self._form_xtx()
        if getattr(self, "_consume", False) and self.xtx.numel():
            h = self.xtx.mul_(2.0 / float(self.count))  # the same float32 product, in place
            self.xtx = torch.empty(0, device=h.device)
            return h
        return self.xtx * (2.0 / float(self.count))

    @contextlib.contextmanager
    def consumed(self) -> Iterator[None]:
        """Inside: :meth:`hessian_matrix` scales ``XᵀX`` in place and gives it up (no second ``d × d`` copy).

        For a caller that resets the statistics right after (weight rounding's commit); the values are the same.
        """
        self._consume = True
        try:
            yield
        finally:
            self._consume = False

    def compute_range(self) -> tuple[Tensor, Tensor]:
        """Per-input-channel ``(min, max)`` over every observed row."""
        self._require()
        return self.min_val, self.max_val

    def _require(self) -> None:
        if not self.has_statistics:
            raise RuntimeError(
                f"{self.name}: no calibration input was observed; run coreai_opt.calibrate(prepared, data) first"
            )

    def reset(self) -> None:
        """Forget everything and release the buffers (the Hessian can be large)."""
        self.count = torch.zeros((), dtype=torch.float64, device=self.count.device)
        for name in (*_SUMS, *_ROWS, "min_val", "max_val"):
            setattr(self, name, torch.empty(0, device=self.count.device))

    # --- distributed ---
    def all_reduce(self, group: object | None = None) -> None:
        """SUM of ``count`` and of the sums, MIN / MAX of the range, over the ranks of ``group``.

        Raises:
            ValueError: on every rank, when ranks observed different channel counts.
        """
        local = (self.num_channels,) if self.num_channels else None
        shape = agree_shape(local, group, what=self.name)
        if shape is None:
            return
        if local is None:
            self._allocate(shape[0], self.count.device)
        if self.hessian:
            self._form_xtx()  # every rank sums the d x d matrix, whatever rows it kept
        self.count = all_reduce(self.count, "sum", group)
        for name in _SUMS:
            if getattr(self, name).numel():
                setattr(self, name, all_reduce(getattr(self, name), "sum", group))
        self.min_val = all_reduce(self.min_val, "min", group)
        self.max_val = all_reduce(self.max_val, "max", group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # noqa: D102, ANN001
        for name in (*_SUMS, *_ROWS, "min_val", "max_val"):
            key = prefix + name
            if key in state_dict:
                setattr(self, name, torch.empty_like(state_dict[key], device=self.count.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def extra_repr(self) -> str:  # noqa: D102
        return f"name={self.name!r}, hessian={self.hessian}, channels={self.num_channels}, rows={int(self.count)}"
