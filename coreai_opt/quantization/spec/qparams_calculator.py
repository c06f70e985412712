"""QParams calculators: turn range statistics into ``(scale, zero_point, minval)``.

A qparams calculator owns exactly one range calculator (built from the spec) and applies
:func:`~coreai_opt.quantization.spec.qparams_math.compute_qparams` to its range. Two kinds exist:

* :class:`StatefulQParamsCalculatorBase` keeps ``scale`` / ``zero_point`` / ``minval`` in buffers (zero point
  and minval are ``None`` for float8). ``observe(x)`` only accumulates statistics, ``commit()`` writes
  qparams into the buffers, ``forward(x)`` does both. Buffer shapes are fixed once allocated (first commit or
  :meth:`~StatefulQParamsCalculatorBase.initialize`). ``set_export_mode(True)`` freezes them: forward then
  returns the cached buffers and observes nothing. ``float_range`` ends, when set, replace the observed
  min and/or max at commit time.
* :class:`StatelessQParamsCalculatorBase` keeps no qparams and recomputes them on every forward (the scale
  shape may follow a variable sequence length); it cannot be frozen for export.

Across ``torch.distributed`` ranks every calculator merges its statistics with one method,
``sync_statistics(group=None, *, only_order_dependent=False)``: the default merges the range calculator
(``range_calculator.all_reduce``), the running calculators of :mod:`qparams_calculators` add their running
range. Every rank must call it, also a rank that saw no data. ``order_dependent`` (class attribute) marks
calculators whose merged result depends on *when* merges happen (``moving_average``); with
``only_order_dependent=True`` the others return at once without any collective.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from coreai_opt.errors import QParamsRangeError
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.spec.qparams_math import QParams, compute_qparams
from coreai_opt.quantization.spec.registry import Registry, RegistryFamily

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = [
    "QParamsCalculatorBase",
    "StatefulQParamsCalculatorBase",
    "StatelessQParamsCalculatorBase",
    "QPARAMS_CALCULATORS",
]


def _short(t: Tensor | None, limit: int = 4) -> str:
    if t is None:
        return "None"
    flat = t.detach().flatten().tolist()
    head = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in flat[:limit])
    return f"[{head}{', ...' if len(flat) > limit else ''}]" if t.dim() else head


class QParamsCalculatorBase(RegistryFamily, nn.Module):
    """Base of every qparams calculator (registry: :data:`QPARAMS_CALCULATORS`).

    Args:
        spec: The quantization spec; the range calculator is
            ``RANGE_CALCULATORS.resolve(spec.range_calculator).from_spec(spec)``.
    """

    stateless: ClassVar[bool] = False
    #: True when merging across ranks at different times gives different results (an EMA); such calculators
    #: are merged after every step by ``calibrate(..., sync="every_batch")``.
    order_dependent: ClassVar[bool] = False
    registry_key: ClassVar[str]

    def __init__(self, spec: QuantizationSpec) -> None:
        super().__init__()
        self.spec = spec
        self.dtype_info = spec.dtype_info
        self.granularity = spec.granularity
        self.range_calculator = RANGE_CALCULATORS.resolve(spec.range_calculator).from_spec(spec)
        self.name = type(self).__name__

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> QParamsCalculatorBase:
        """Build the calculator (and its range calculator) from ``spec``."""
        return cls(spec)

    # --- shared behaviour ---
    @property
    def quant_min(self) -> int | float:
        """Lowest quantized value of the spec (narrowed for ``symmetric_with_clipping``)."""
        return self.spec.quant_min

    @property
    def quant_max(self) -> int | float:
        """Highest quantized value of the spec."""
        return self.spec.quant_max

    def set_name(self, name: str) -> None:
        """Name this calculator (and its range calculator) after the tensor it serves, for messages."""
        self.name = name
        self.range_calculator.name = f"{name}.{type(self.range_calculator).__name__}"

    def compute_qparams(self, min_val: Tensor, max_val: Tensor) -> QParams:
        """Apply :func:`~coreai_opt.quantization.spec.qparams_math.compute_qparams` with the spec's dtype/scheme."""
        return compute_qparams(min_val, max_val, self.dtype_info, self.spec.qscheme)

    def sync_statistics(self, group: object | None = None, *, only_order_dependent: bool = False) -> None:
        """Merge the statistics across the ranks of ``group``; afterwards every rank holds the same statistics.

        The default merges the range calculator (:meth:`RangeCalculatorBase.all_reduce`, e.g. MIN / MAX of the
        last-batch range for ``minmax``, SUM of the histograms for percentile / mse / entropy). Qparams are
        not recomputed: :meth:`commit` afterwards. Safe on a rank that saw no data.

        Args:
            group: Process group (default: the world). Every rank of it must call this method.
            only_order_dependent: Merge only order-dependent statistics (see :attr:`order_dependent`); a
                calculator without any returns at once, without a collective.

        Raises:
            ValueError: on every rank, when ranks observed different qparam shapes.
        """
        if only_order_dependent and not self.order_dependent:
            return
        self.range_calculator.all_reduce(group)

    def extra_repr(self) -> str:  # noqa: D102
        return f"name={self.name!r}, dtype={self.spec.dtype}, qscheme={self.spec.qscheme.value}, " \
            f"granularity={self.granularity}"


QPARAMS_CALCULATORS: Registry[type[QParamsCalculatorBase]] = Registry(
    "qparams calculator", QParamsCalculatorBase, field="qparams_calculator"
)


class StatefulQParamsCalculatorBase(QParamsCalculatorBase):
    """Qparams kept in buffers with a fixed shape; observe / commit / freeze.

    Buffers: ``scale`` (float32), ``zero_point`` (int32) and ``minval`` (float32), the last two ``None`` for
    float8; ``committed`` (bool) records whether qparams were ever computed. Subclasses decide which range
    :meth:`commit` uses by overriding :meth:`observe` / :meth:`observed_range` / :attr:`has_statistics`.

    ``batches_since_sync`` (int attribute, not in ``state_dict``) counts the :meth:`observe` calls since the
    last :meth:`sync_statistics` or :meth:`reset_statistics`: a rank's weight in batch-weighted merges.
    """

    scale: Tensor
    zero_point: Tensor | None
    minval: Tensor | None

    def __init__(self, spec: QuantizationSpec) -> None:
        super().__init__(spec)
        is_float = self.dtype_info.is_float
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("zero_point", None if is_float else torch.empty(0, dtype=torch.int32))
        self.register_buffer("minval", None if is_float else torch.empty(0))
        self.register_buffer("committed", torch.tensor(False))
        self.export_mode = False
        self.batches_since_sync = 0

    # --- state ---
    @property
    def has_qparams(self) -> bool:
        """True once qparams were committed (or loaded from a calibrated state_dict)."""
        return bool(self.committed)

    @property
    def has_statistics(self) -> bool:
        """True when :meth:`observe` has seen at least one finite value since the last reset."""
        return self.range_calculator.has_statistics

    def initialize(self, tensor_shape: tuple[int, ...] | torch.Size, device: torch.device | None = None) -> None:
        """Allocate the qparam buffers for tensors of ``tensor_shape`` (no qparams are computed).

        Raises:
            ValueError: buffers already exist with another shape.
        """
        self._allocate(self.granularity.qparam_shape(tuple(tensor_shape)), device or self.scale.device)

    def _allocate(self, shape: tuple[int, ...], device: torch.device) -> None:
        if self.scale.numel() > 0 or self.has_qparams:
            if tuple(self.scale.shape) != tuple(shape):
                raise ValueError(
                    f"{self.name}: qparam shape changed from {tuple(self.scale.shape)} to {tuple(shape)}; a stateful "
                    "calculator keeps one shape. Use a StatelessQParamsCalculatorBase (qparams_calculator='dynamic') "
                    "for tensors whose quantized dimensions vary."
                )
            return
        self.scale = torch.ones(shape, device=device)
        if self.zero_point is not None:
            self.zero_point = torch.zeros(shape, dtype=torch.int32, device=device)
            self.minval = torch.zeros(shape, device=device)

    # --- statistics ---
    def observe(self, x: Tensor) -> None:
        """Accumulate statistics of ``x`` (nothing in export mode, nothing for an empty ``x``). Cheap."""
        if not self.export_mode and x.numel() > 0:
            self.range_calculator.update(x)
            self.__dict__["batches_since_sync"] += 1  # plain int attribute; skips nn.Module.__setattr__ (hot path)

    def sync_statistics(self, group: object | None = None, *, only_order_dependent: bool = False) -> None:  # noqa: D102
        if only_order_dependent and not self.order_dependent:
            return
        super().sync_statistics(group)
        self.batches_since_sync = 0

    def observed_range(self) -> tuple[Tensor, Tensor]:
        """Return the ``(min, max)`` that :meth:`commit` turns into qparams."""
        return self.range_calculator.compute_range()

    def reset_statistics(self) -> None:
        """Forget all statistics (committed qparams stay)."""
        self.range_calculator.reset()
        self.batches_since_sync = 0

    def commit(self) -> QParams:
        """Compute qparams from the statistics (``float_range`` ends override them) into the buffers.

        Raises:
            RuntimeError: nothing observed and ``float_range`` does not fix both ends.
            ValueError: the qparam shape differs from the allocated one.
        """
        float_range = self.spec.float_range
        if self.has_statistics:
            mn, mx = self.observed_range()
            if float_range is not None and float_range[0] is not None:
                mn = torch.full_like(mn, float_range[0])
            if float_range is not None and float_range[1] is not None:
                mx = torch.full_like(mx, float_range[1])
        elif float_range is not None and None not in float_range:
            if self.scale.numel() > 0:
                shape = tuple(self.scale.shape)
            elif self.granularity.type_name == "per_tensor":
                shape = ()
            else:
                raise RuntimeError(
                    f"{self.name}: float_range fixes the range but the {self.granularity.type_name} qparam shape "
                    "is unknown; call initialize(tensor_shape) or observe a tensor first"
                )
            mn = torch.full(shape, float(float_range[0]), device=self.scale.device)
            mx = torch.full(shape, float(float_range[1]), device=self.scale.device)
        else:
            raise RuntimeError(
                f"{self.name}: commit() needs observed statistics but no finite value was observed; "
                "run calibration data through the model first"
            )
        qparams = self._checked_qparams(mn, mx)
        self._allocate(tuple(qparams.scale.shape), qparams.scale.device)
        with torch.no_grad():
            self.scale.copy_(qparams.scale)
            if self.zero_point is not None and self.minval is not None:
                self.zero_point.copy_(qparams.zero_point)
                self.minval.copy_(qparams.minval)
            self.committed.fill_(True)
        return qparams

    def _checked_qparams(self, min_val: Tensor, max_val: Tensor) -> QParams:
        """:meth:`compute_qparams`, refusing (before anything is stored) qparams float32 cannot hold.

        Raises:
            QParamsRangeError: NaN bounds, or a scale that is not finite and positive / a ``minval`` that is not
                finite (names this quantizer).
        """
        try:
            qparams = self.compute_qparams(min_val, max_val)
        except QParamsRangeError as exc:
            raise QParamsRangeError(f"{self.name}: {exc}") from exc
        scale, minval = qparams.scale, qparams.minval
        bad_scale = ~(torch.isfinite(scale) & (scale > 0))
        bad_minval = ~torch.isfinite(minval) if minval is not None else torch.zeros_like(bad_scale)
        if bool(bad_scale.any()) or bool(bad_minval.any()):
            index = int(torch.nonzero((bad_scale | bad_minval).reshape(-1))[0])
            raise QParamsRangeError(
                f"{self.name}: the range [{float(min_val.reshape(-1)[index])}, {float(max_val.reshape(-1)[index])}] "
                f"gives scale {float(scale.reshape(-1)[index])}, which float32 qparams cannot represent; check the "
                "tensor feeding this quantizer (values near float32's limit of 3.4e38 usually mean an overflow "
                "upstream) or fix its range with float_range"
            )
        return qparams

    # --- forward / freeze ---
    def _buffers_tuple(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        return self.scale, self.zero_point, self.minval

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Observe ``x``, commit and return ``(scale, zero_point, minval)``; in export mode return the buffers."""
        if self.export_mode:
            return self._buffers_tuple()
        self.observe(x)
        scale, zero_point, minval = self.commit()
        return scale, zero_point, minval

    def get_qparams(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Return the buffers ``(scale, zero_point, minval)``; warns when no qparams were computed yet."""
        if not self.has_qparams:
            warnings.warn(
                f"{self.name}: get_qparams() called before any qparams were computed; the buffers are placeholders",
                RuntimeWarning,
                stacklevel=2,
            )
        return self._buffers_tuple()

    def set_export_mode(self, enabled: bool = True) -> None:
        """Freeze (``True``) or unfreeze the qparams.

        Raises:
            RuntimeError: enabling export mode before any qparams were computed.
        """
        if enabled and not self.has_qparams:
            raise RuntimeError(
                f"{self.name}: cannot enter export mode without qparams; run coreai_opt.calibrate(...) "
                "(or commit() after observing data) first"
            )
        self.export_mode = bool(enabled)

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{super().extra_repr()}, export_mode={self.export_mode}, "
            f"scale={_short(self.scale) if self.has_qparams else 'unset'}, "
            f"zero_point={_short(self.zero_point) if self.has_qparams else 'unset'}"
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # noqa: D102, ANN001
        # Qparam / statistics buffers are shaped by the data: adopt the saved shapes before copying, so that a
        # calibrated state_dict loads into a freshly built, never-run calculator.
        for name, buf in list(self._buffers.items()):
            key = prefix + name
            if buf is not None and key in state_dict and state_dict[key].shape != buf.shape:
                self._buffers[name] = torch.empty(state_dict[key].shape, dtype=buf.dtype, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


class StatelessQParamsCalculatorBase(QParamsCalculatorBase):
    """Qparams recomputed from every tensor; nothing cached, nothing to freeze or export."""

    stateless: ClassVar[bool] = True

    @property
    def has_qparams(self) -> bool:
        """Always False: qparams exist only for the tensor being processed."""
        return False

    def observe(self, x: Tensor) -> None:
        """No-op: a stateless calculator has no statistics to accumulate."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Return qparams computed from ``x`` alone (shape follows ``x``).

        An empty ``x`` has no range; it gets the qparams of the range ``[0, 0]`` (its quantized value is empty
        whatever they are).
        """
        if x.numel() == 0:
            zeros = torch.zeros(self.granularity.qparam_shape(tuple(x.shape)), device=x.device)
            scale, zero_point, minval = self.compute_qparams(zeros, zeros)
            return scale, zero_point, minval
        self.range_calculator.update(x)
        mn, mx = self.range_calculator.compute_range()
        scale, zero_point, minval = self.compute_qparams(mn, mx)
        return scale, zero_point, minval

    def get_qparams(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Raise: a stateless calculator caches no qparams."""
        raise RuntimeError(f"{self.name}: a stateless qparams calculator has no cached qparams; call it on a tensor")

    def set_export_mode(self, enabled: bool = True) -> None:
        """Raise when enabling: stateless qparams cannot be frozen into an exported graph."""
        if enabled:
            raise RuntimeError(
                f"{self.name}: a stateless (dynamic) qparams calculator cannot be frozen for export; use a "
                "stateful qparams_calculator such as 'static' or 'moving_average'"
            )

    def reset_statistics(self) -> None:
        """Forget the last tensor's statistics."""
        self.range_calculator.reset()

    def sync_statistics(self, group: object | None = None, *, only_order_dependent: bool = False) -> None:
        """No-op: nothing persists between calls, so there is nothing to merge (and no collective runs)."""
