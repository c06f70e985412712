"""Weight rounding: how a weight quantizer turns a float weight into ``(integer weight, scale, zero point)``.

The default weight quantizer rounds ``round(w / s) + z`` with ``s`` from the min/max range. A spec with
``weight_rounding="<key>"`` hands the weight to an algorithm of the :data:`WEIGHT_ROUNDING` registry instead:

=========  =====================================================================  ============
key        what it does                                                           data
=========  =====================================================================  ============
``rtn``    round to nearest; symmetric uses the full signed range (``vmax/−8``)   none
``mse``    per-block clip search (+ least-squares scale) minimising the           optional
           weight error weighted by the input second moments ``E[x_j²]``
``hqq``    half-quadratic optimisation of the zero point, then integer zero       none
           points and least-squares scales
``gptq``   GPTQ: columns rounded in order, each error compensated on the          Hessian
           remaining columns through the inverse Hessian of the layer input
=========  =====================================================================  ============

``gptq_mse`` is GPTQ whose block qparams come from the clip search weighted by ``H_jj``.

Every algorithm returns a :class:`RoundedWeight` in the spec's dtype and granularity, so the quantizer's
output is exactly ``(q − z)·s``, representable as ``DequantizeLinear(int W, s, z)`` and identical in eager and
ONNX. The result lives in the algorithm module (buffers ``qweight``, ``scale``, ``zero_point`` and the
``fingerprint`` of the weight it was computed from); the user's weight is never modified.

Data-aware algorithms own an :class:`~coreai_opt.quantization.rounding.input_statistics.InputStatistics` child
(``statistics``), which the graph pass calls on the linear's input edge; weights that have no such edge
(convolutions, embeddings) are rounded by the algorithm's data-free path (documented per class).

Users register their own: subclass :class:`WeightRoundingBase`, implement :meth:`~WeightRoundingBase.round_weight`
and decorate with ``@WEIGHT_ROUNDING.register("key")``.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.rounding_math import quantize_rows, rtn_qparams
from coreai_opt.quantization.spec.granularity import Granularity
from coreai_opt.quantization.spec.registry import Registry, RegistryFamily

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["WEIGHT_ROUNDING", "RoundedWeight", "RTNRounding", "WeightRoundingBase", "rounding_results",
           "weight_fingerprint"]


class RoundedWeight(NamedTuple):
    """The result of a rounding algorithm.

    Attributes:
        q: Integers (int32), the weight's shape, within the spec's ``[quant_min, quant_max]``.
        scale: float32, the granularity's qparam shape (may be negative: signed scales).
        zero_point: int32, the qparam shape.
    """

    q: Tensor
    scale: Tensor
    zero_point: Tensor


#: Elements summed at a time by :func:`weight_fingerprint`.
_FINGERPRINT_CHUNK = 1 << 22
#: Elements dequantized (:meth:`WeightRoundingBase.dequantized`) or rounded (``RTNRounding``) at a time.
_ROW_CHUNK = 1 << 20


def weight_fingerprint(x: Tensor) -> Tensor:
    """An exact, order-independent fingerprint of a tensor's bits: the int64 sum of its raw element bits.

    Any change of a single element changes it; it is deterministic whatever the thread count (integer sum).
    """
    flat = x.detach().contiguous().reshape(-1)
    bits = flat.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[flat.element_size()])
    # In chunks: the sum's int64 cast of a whole weight would be twice a float32 weight (an exact integer sum,
    # so the chunking changes no bit).
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for chunk in bits.split(_FINGERPRINT_CHUNK):
        total += chunk.sum(dtype=torch.int64)
    return total


class WeightRoundingBase(RegistryFamily, nn.Module):
    """Base of the weight-rounding family (registry :data:`WEIGHT_ROUNDING`).

    Args:
        spec: The weight quantizer's spec (integer dtype, any granularity).

    Class attributes:
        statistics_kind: ``None`` (data-free), ``"moments"`` (per-channel second moments, optional) or
            ``"hessian"`` (``XᵀX`` of the layer input, required for linear weights).
    """

    statistics_kind: ClassVar[str | None] = None
    registry_key: ClassVar[str]

    def __init__(self, spec: QuantizationSpec) -> None:
        super().__init__()
        if spec.dtype_info.is_float or spec.dtype_info.bits > 8:
            raise ValueError(
                f"weight_rounding needs an integer dtype of at most 8 bits, got {spec.dtype!r}; drop weight_rounding "
                "or use int4 / uint4 / int8 / uint8"
            )
        self.spec = spec
        self.name = type(self).__name__
        self.statistics: InputStatistics | None = (
            InputStatistics(hessian=self.statistics_kind == "hessian") if self.statistics_kind else None
        )
        self.register_buffer("qweight", torch.empty(0, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("zero_point", torch.empty(0, dtype=torch.int32))
        self.register_buffer("fingerprint", torch.zeros((), dtype=torch.int64))
        self.register_buffer("awaiting_data", torch.tensor(False))
        self.register_buffer("export_weight", None, persistent=False)

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> WeightRoundingBase:
        """Build the algorithm from ``spec``."""
        return cls(spec)

    def set_name(self, name: str) -> None:
        """Name the algorithm (and its statistics) after the weight it serves."""
        self.name = f"{name}.{self.registry_key}"
        if self.statistics is not None:
            self.statistics.name = f"{name}.input_statistics"

    # --- the algorithm ---
    def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:
        """Round ``weight`` (float32, detached); ``statistics`` holds observed inputs or is None."""
        raise NotImplementedError

    # --- state ---
    @property
    def has_result(self) -> bool:
        """True once a weight was rounded (or a rounded state was loaded)."""
        return self.qweight.numel() > 0

    def matches(self, weight: Tensor) -> bool:
        """True when the stored result was computed from exactly this weight (same shape and bits)."""
        return (self.has_result and tuple(self.qweight.shape) == tuple(weight.shape)
                and bool(self.fingerprint == weight_fingerprint(weight)))

    def commit(self, weight: Tensor) -> RoundedWeight:
        """Round ``weight`` unless the stored result already belongs to it and no new statistics arrived.

        New calibration statistics are consumed (released afterwards: a Hessian is ``d × d``). A ``"hessian"``
        algorithm on a linear weight (statistics attached by the graph pass) without statistics rounds with its
        data-free path and sets :attr:`awaiting_data`; ``convert`` refuses such a quantizer.
        """
        stats = self.statistics
        fresh = stats is not None and stats.has_statistics
        if not fresh and self.matches(weight):
            return RoundedWeight(self.qweight.int(), self.scale, self.zero_point)
        with torch.no_grad(), stats.consumed() if fresh else contextlib.nullcontext():
            result = self.round_weight(weight.detach().float(), stats if fresh else None)
        qmin, qmax = int(self.spec.quant_min), int(self.spec.quant_max)
        if int(result.q.min()) < qmin or int(result.q.max()) > qmax:
            raise RuntimeError(f"{self.name}: integers outside [{qmin}, {qmax}] (a bug of the algorithm)")
        self.qweight = result.q.to(torch.int8)
        self.scale = result.scale.float()
        self.zero_point = result.zero_point.to(torch.int32)
        self.fingerprint = weight_fingerprint(weight)
        self.awaiting_data.fill_(self.statistics_kind == "hessian" and stats is not None and stats.attached
                                 and not fresh)
        self.export_weight = None
        if fresh:
            stats.reset()
        return result

    def dequantized(self) -> Tensor:
        """``(q − z)·s`` in the weight's shape (float32): the value every mode computes for this weight.

        Computed on chunks of the rows view when it is a view of the weight (per-tensor, per-channel axis 0,
        per-block along the last axis): no weight-sized temporary besides the result, the same values.
        """
        granularity = self.spec.granularity
        out = torch.empty(self.qweight.shape, device=self.qweight.device)
        out_rows = granularity.to_rows(out)
        if not (out_rows._is_view() and out_rows.data_ptr() == out.data_ptr() and out_rows.is_contiguous()):
            q = self.qweight.float()
            return (q - granularity.expand(self.zero_point.float(), q)) * granularity.expand(self.scale, q)
        q_rows = granularity.to_rows(self.qweight)
        scale, zero = self.scale.reshape(-1, 1), self.zero_point.float().reshape(-1, 1)
        step = max(1, _ROW_CHUNK // max(1, q_rows.shape[1]))
        for start in range(0, q_rows.shape[0], step):
            rows = slice(start, start + step)
            torch.mul(q_rows[rows].float() - zero[rows], scale[rows], out=out_rows[rows])
        return out

    def dequantized_rows(self, rows: slice) -> Tensor:
        """Rows ``rows`` (along axis 0) of :meth:`dequantized`, the same values, computed from those rows alone.

        When the qparam rows view is not a view of the weight, or does not split at those rows (per tensor), the
        whole weight is dequantized and sliced.
        """
        granularity, shape = self.spec.granularity, tuple(self.qweight.shape)
        start, stop, _ = rows.indices(shape[0])
        q_rows = granularity.to_rows(self.qweight)
        row_length = math.prod(shape[1:])
        columns = q_rows.shape[1] if q_rows.dim() == 2 else 0
        aligned = (columns > 0 and q_rows._is_view() and q_rows.data_ptr() == self.qweight.data_ptr()
                   and q_rows.is_contiguous() and (start * row_length) % columns == 0
                   and (stop * row_length) % columns == 0)
        if not aligned:
            return self.dequantized()[start:stop]
        first, last = start * row_length // columns, stop * row_length // columns
        scale, zero = self.scale.reshape(-1, 1)[first:last], self.zero_point.float().reshape(-1, 1)[first:last]
        return ((q_rows[first:last].float() - zero) * scale).reshape(stop - start, *shape[1:])

    def weight_for(self, weight: Tensor, export_mode: bool) -> Tensor:
        """The tensor the quantizer rounds in place of ``weight``: its exact dequantized result.

        In export mode: :attr:`export_weight` when ``export_onnx`` set it for its trace (a buffer the exporter
        stores as the weight, see :mod:`coreai_opt.onnx.export.rounded_weights`), else computed on each call and never
        kept (an eager forward of a converted model holds one such weight at a time, not a float copy of all).

        Raises:
            RuntimeError: not in export mode and ``weight`` is not the weight the result was computed from.
        """
        if export_mode:
            return self.export_weight if self.export_weight is not None else self.dequantized()
        if not self.matches(weight):
            raise RuntimeError(
                f"{self.name}: the weight changed since it was rounded; run coreai_opt.calibrate(prepared, data) "
                "again (weights are re-rounded at its end) or call the quantizer's commit()"
            )
        return self.dequantized()

    def extra_repr(self) -> str:  # noqa: D102
        return f"name={self.name!r}, rounded={self.has_result}, awaiting_data={bool(self.awaiting_data)}"


WEIGHT_ROUNDING: Registry[type[WeightRoundingBase]] = Registry(
    "weight rounding", WeightRoundingBase, field="weight_rounding"
)


def rounding_results(model: nn.Module) -> list[Tensor]:
    """Every rounding result tensor of ``model`` (``qweight``, ``scale``, ``zero_point``).

    :meth:`WeightRoundingBase.commit` binds new tensors and nothing writes them in place, so a copy of ``model``
    may share them (``convert``).
    """
    results = []
    for module in model.modules():
        if isinstance(module, WeightRoundingBase) and module.has_result:
            results += [module.qweight, module.scale, module.zero_point]
    return results


@WEIGHT_ROUNDING.register("rtn")
class RTNRounding(WeightRoundingBase):
    """Round to nearest per qparam group: full signed range (symmetric) or min/max (asymmetric).

    Symmetric int4 maps the element of largest magnitude onto −8 with a signed scale ``s = v / −8``
    (see :mod:`~coreai_opt.quantization.rounding.rounding_math`), using all 16 levels.
    """

    def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:  # noqa: D102
        granularity = self.spec.granularity
        rows = granularity.to_rows(weight)
        qmin, qmax = int(self.spec.quant_min), int(self.spec.quant_max)
        # On row chunks (every operation is per row: the same bits): no weight-sized float temporaries.
        q = torch.empty(rows.shape, dtype=torch.int32, device=rows.device)
        scale = torch.empty(rows.shape[0], device=rows.device)
        zero_point = torch.empty(rows.shape[0], dtype=torch.int32, device=rows.device)
        step = max(1, _ROW_CHUNK // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            r = slice(start, start + step)
            scale[r], zero_point[r] = rtn_qparams(rows[r], self.spec.dtype_info, self.spec.qscheme)
            q[r] = quantize_rows(rows[r], scale[r], zero_point[r], qmin, qmax)
        return rows_result(q, scale, zero_point, weight, granularity)


def rows_result(
    q_rows: Tensor, scale: Tensor, zero_point: Tensor, weight: Tensor, granularity: Granularity
) -> RoundedWeight:
    """Reshape a rows-view result (``(R, N)`` integers, ``(R,)`` qparams) back to the weight / qparam shapes."""
    shape = tuple(weight.shape)
    q = _from_rows_view(q_rows, shape, granularity)
    return RoundedWeight(
        q.to(torch.int32), granularity.from_rows(scale, shape), granularity.from_rows(zero_point, shape)
    )


def _from_rows_view(rows: Tensor, shape: tuple[int, ...], granularity: Granularity) -> Tensor:
    """Inverse of ``granularity.to_rows`` (found through the index permutation, exact for every granularity).

    When the rows view of a contiguous tensor is itself a contiguous view (per-tensor, per-channel axis 0,
    per-block along the last axis: checked on a meta tensor) the permutation is the identity and the inverse a
    reshape; otherwise an int64 index of the weight's size (twice a float32 weight) finds it.
    """
    probe = granularity.to_rows(torch.empty(shape, device="meta"))
    if probe._is_view() and probe.is_contiguous() and probe.storage_offset() == 0:
        return rows.reshape(shape)
    index = torch.arange(rows.numel(), device=rows.device).reshape(shape)
    order = granularity.to_rows(index).reshape(-1)
    out = torch.empty(rows.numel(), dtype=rows.dtype, device=rows.device)
    out[order] = rows.reshape(-1)
    return out.reshape(shape)
