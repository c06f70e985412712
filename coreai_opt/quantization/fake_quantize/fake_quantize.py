"""``FakeQuantize``: the nn.Module a graph pass inserts next to a weight or activation.

It owns exactly one qparams calculator (``self.calculator``) and applies the custom op
``coreai_opt::quantize_dequantize``: ``y = (clamp(round(x / s) + z, qmin, qmax) − z) · s``, with a
straight-through gradient masked where clamped. The same op runs in every mode, so a prepared model with
observers off and the converted (export-mode) model give bitwise identical outputs.

=========================  ==================================================================
observer / fake-quant      forward(x)
=========================  ==================================================================
on / off (calibration)     ``calculator.observe(x)``; returns ``x`` (qparams committed lazily)
on / on (QAT)              observe + commit + fake-quantize with the fresh qparams
off / on (evaluation)      fake-quantize with the cached qparams (pending statistics are committed
                           first); RuntimeError when none exist
off / off                  identity
export mode                fake-quantize with the frozen buffers; flags and statistics untouched
=========================  ==================================================================

Weight rounding (``spec.weight_rounding``): the quantizer owns the algorithm in ``self.rounding``. ``observe``
remembers the weight (a reference), ``commit`` rounds it (:meth:`WeightRoundingBase.commit`) and copies the
algorithm's scale / zero point into the calculator's buffers; every fake-quantized output is then computed from
the algorithm's exact result ``(q − z)·s`` (its integers may differ from ``round(w / s) + z``: GPTQ, HQQ).

fp16/bf16 inputs: qparams stay float32; the op computes in float32 and the result is cast back to the
input dtype (in ONNX this appears as Cast nodes around the Q/DQ pair).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from coreai_opt.quantization.ops.quantize_dequantize_op import quantize_dequantize
from coreai_opt.quantization.rounding import WEIGHT_ROUNDING, WeightRoundingBase
from coreai_opt.quantization.spec.qparams_calculator import (
    QPARAMS_CALCULATORS,
    QParamsCalculatorBase,
    StatefulQParamsCalculatorBase,
)
from coreai_opt.quantization.spec.qparams_math import QParams
from coreai_opt.quantization.spec.registry import Registry, RegistryFamily

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["FakeQuantize", "FAKE_QUANTIZE", "spec_summary"]

_SUMMARY_ALWAYS = ("dtype", "qscheme", "granularity")


def _granularity_text(value: Any) -> str:
    if isinstance(value, dict) and "type" in value:
        rest = ", ".join(f"{k}={v}" for k, v in value.items() if k != "type")
        return f"{value['type']}({rest})" if rest else str(value["type"])
    return str(value)


def spec_summary(spec: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """A short text of a spec dict: dtype, qscheme, granularity, plus every field that differs from ``other``.

    Example:
        >>> spec_summary({"dtype": "int8", "qscheme": "symmetric", "granularity": {"type": "per_tensor"}})
        'int8 symmetric per_tensor'
    """
    if not isinstance(spec, dict):
        return repr(spec)
    parts = [_granularity_text(spec[k]) if k == "granularity" else str(spec[k]) for k in _SUMMARY_ALWAYS if k in spec]
    if other is not None:
        for key in sorted(set(spec) | set(other)):
            if key not in _SUMMARY_ALWAYS and spec.get(key) != other.get(key):
                parts.append(f"{key}={spec.get(key, '<unset>')}")
    return " ".join(parts)


class FakeQuantize(RegistryFamily, nn.Module):
    """Fake-quantize a tensor according to a :class:`~coreai_opt.quantization.spec.QuantizationSpec`.

    Base of the fake-quantize family (registry :data:`FAKE_QUANTIZE`, this class is ``"default"``).

    Args:
        spec: The quantization spec. The calculator is
            ``QPARAMS_CALCULATORS.resolve(spec.qparams_calculator).from_spec(spec)``.

    Attributes:
        calculator: The qparams calculator.
        observer_enabled: bool buffer; statistics are collected when True.
        fake_quant_enabled: bool buffer; the output is fake-quantized when True.
        export_mode: True after ``set_export_mode(True)``: qparams frozen.
        name: Used in messages; the graph pass sets it to the tensor it serves (``"conv1.output"``).
    """

    registry_key: str
    observer_enabled: Tensor
    fake_quant_enabled: Tensor
    #: True for a quantizer whose qparams come from every tensor at run time and that still exports
    #: (:class:`~coreai_opt.quantization.fake_quantize.dynamic_fake_quantize.DynamicFakeQuantize`, ONNX
    #: ``DynamicQuantizeLinear``): it quantizes the input of one consumer, never a tensor's stored value.
    exports_dynamic: ClassVar[bool] = False
    #: Submodule path, relative to the quantizer, of the ``InputStatistics`` a data-aware weight rounding observes
    #: (``insert_weight_statistics`` calls it on the layer input; see :attr:`rounds_with_data`).
    INPUT_STATISTICS: ClassVar[str] = "rounding.statistics"

    def __init__(self, spec: QuantizationSpec) -> None:
        super().__init__()
        self.spec = spec
        self.calculator: QParamsCalculatorBase = QPARAMS_CALCULATORS.resolve(spec.qparams_calculator).from_spec(spec)
        self.register_buffer("observer_enabled", torch.tensor(True))
        self.register_buffer("fake_quant_enabled", torch.tensor(True))
        self.rounding: WeightRoundingBase | None = (
            WEIGHT_ROUNDING.resolve(spec.weight_rounding).from_spec(spec) if spec.weight_rounding else None
        )
        self.export_mode = False
        self.name = type(self).__name__
        self._pending = False  # statistics observed but not committed yet
        self._observed_weight: Tensor | None = None  # the tensor weight rounding will round at commit

    @classmethod
    def from_spec(cls, spec: QuantizationSpec) -> FakeQuantize:
        """Build the module from ``spec``."""
        return cls(spec)

    # --- qparams and statistics ---
    @property
    def stateful(self) -> bool:
        """True when the calculator caches qparams in buffers (False: computed from every tensor)."""
        return isinstance(self.calculator, StatefulQParamsCalculatorBase)

    @property
    def has_qparams(self) -> bool:
        """True once qparams were committed (or loaded from a calibrated ``state_dict``)."""
        return self.calculator.has_qparams

    @property
    def has_statistics(self) -> bool:
        """True when statistics were observed since the last reset (always False when stateless)."""
        return self.stateful and self.calculator.has_statistics

    def get_qparams(self) -> QParams:
        """The cached ``(scale, zero_point, minval)`` buffers of a stateful quantizer.

        The tensors are the current buffers; a later commit (calibration, every QAT step, weight rounding) may
        update or replace them, so a reader that must follow the scales, like the derived int32 bias
        ``s_b = s_in · s_w``, calls this at every use. Before the first commit they are placeholders
        (``has_qparams`` is False).

        Raises:
            RuntimeError: the quantizer is stateless (its qparams exist only for the tensor being quantized).
        """
        if not self.stateful:
            raise RuntimeError(
                f"{self.name}: a dynamic (stateless) quantizer caches no qparams; they are computed from every "
                "tensor it quantizes"
            )
        return QParams(self.calculator.scale, self.calculator.zero_point, self.calculator.minval)

    def observe(self, x: Tensor) -> None:
        """Accumulate statistics of ``x`` without changing the qparams (:meth:`commit` turns them into qparams).

        With weight rounding, ``x`` (the weight) is also remembered for :meth:`commit` to round. An empty ``x``
        (a KV cache of past length 0 at prefill) holds no values and changes nothing.
        """
        if not self.stateful or x.numel() == 0:
            return
        self.calculator.observe(x)
        if self.rounding is not None:
            self._observed_weight = x.detach()
        self._pending = True

    # --- configuration ---
    def set_name(self, name: str) -> None:
        """Name this quantizer and its calculators after the tensor it serves."""
        self.name = name
        self.calculator.set_name(name)
        if self.rounding is not None:
            self.rounding.set_name(name)

    def enable_observer(self, enabled: bool = True) -> None:
        """Switch statistics collection on or off."""
        self.observer_enabled.fill_(bool(enabled))

    def enable_fake_quant(self, enabled: bool = True) -> None:
        """Switch fake quantization on or off."""
        self.fake_quant_enabled.fill_(bool(enabled))

    def initialize(self, tensor_shape: tuple[int, ...] | torch.Size) -> None:
        """Pre-allocate the qparam buffers for tensors of ``tensor_shape`` (no-op for stateless calculators)."""
        if isinstance(self.calculator, StatefulQParamsCalculatorBase):
            self.calculator.initialize(tensor_shape)

    def commit(self) -> None:
        """Turn pending statistics into qparams (``calibrate`` calls this at the end).

        With weight rounding, the observed weight is rounded and the algorithm's qparams replace the calculator's.
        """
        if isinstance(self.calculator, StatefulQParamsCalculatorBase) and self.calculator.has_statistics:
            self.calculator.commit()
        if self.rounding is not None and self._observed_weight is not None:
            self.rounding.commit(self._observed_weight)
            self._observed_weight = None
        if self.rounding is not None and self.rounding.has_result:
            self._adopt_rounding_qparams()
        self._pending = False

    def _adopt_rounding_qparams(self) -> None:
        calculator = self.calculator
        rounding = self.rounding
        if not isinstance(calculator, StatefulQParamsCalculatorBase) or rounding is None:
            return
        with torch.no_grad():
            calculator.scale = rounding.scale.clone()
            calculator.zero_point = rounding.zero_point.clone()
            calculator.minval = (float(self.spec.quant_min) - rounding.zero_point.float()) * rounding.scale
            calculator.committed.fill_(True)

    @property
    def rounds_with_data(self) -> bool:
        """True when the weight rounding needs statistics of the layer input (GPTQ, weighted MSE)."""
        return self.rounding is not None and self.rounding.statistics is not None

    @property
    def has_input_statistics(self) -> bool:
        """True when weight rounding holds calibration statistics not yet used by :meth:`commit`."""
        stats = self.rounding.statistics if self.rounding is not None else None
        return stats is not None and stats.has_statistics

    def reset_statistics(self) -> None:
        """Forget observed statistics and any pending commit (``calibrate`` calls this on entry)."""
        self.calculator.reset_statistics()
        self._pending = False

    def set_export_mode(self, enabled: bool = True) -> None:
        """Freeze (``True``): commit pending statistics, freeze the calculator, observer off, fake-quant on.

        Raises:
            RuntimeError: no qparams exist, or the calculator is stateless.
        """
        if enabled:
            if self._pending:
                self.commit()
            self.calculator.set_export_mode(True)
            self.enable_observer(False)
            self.enable_fake_quant(True)
        else:
            self.calculator.set_export_mode(False)
        self.export_mode = bool(enabled)

    # --- state_dict: the spec travels with the statistics ---
    def get_extra_state(self) -> dict[str, Any]:
        """The spec dict (``QuantizationSpec.to_dict()``), saved as ``<prefix>_extra_state`` in ``state_dict``."""
        return self.spec.to_dict()

    def set_extra_state(self, state: Any) -> None:
        """Check that a loaded state was saved by a quantizer with the same spec.

        Raises:
            ValueError: the saved spec differs from this quantizer's spec (names both).
        """
        current = self.spec.to_dict()
        if isinstance(state, dict) and "weight_rounding" not in state:  # saved before the field existed
            state = {**state, "weight_rounding": None}
        if state != current:
            raise ValueError(
                f"{self.name}: state was saved with {spec_summary(state, current)} but this quantizer is "
                f"{spec_summary(current, state if isinstance(state, dict) else None)}; prepare with the config "
                "used when saving (prepared.meta['coreai_opt']['config'])"
            )

    # --- forward ---
    def _fake_quant(self, x: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
        if self.rounding is not None and self.rounding.has_result:
            rounded = self.rounding.weight_for(x, self.export_mode).to(x.dtype)
            # eager: straight-through (the op re-rounds x + (rounded - x) to exactly `rounded`)
            x = rounded if self.export_mode else x + (rounded - x).detach()
        if zero_point is None:  # float8: the op takes a zero tensor it ignores (typed zero point in ONNX)
            zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
        x32 = x if x.dtype == torch.float32 else x.float()
        y = quantize_dequantize(
            x32,
            scale,
            zero_point,
            int(self.spec.quant_min),
            int(self.spec.quant_max),
            self.spec.granularity.onnx_axis(x.dim()),
            self.spec.granularity.block_size,
            self.spec.dtype,
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _cached_qparams(self) -> tuple[Tensor, Tensor | None]:
        calculator = self.calculator
        if self._pending:
            self.commit()
        if not isinstance(calculator, StatefulQParamsCalculatorBase) or not calculator.has_qparams:
            raise RuntimeError(
                f"{self.name}: fake quantization is on but no qparams were computed; "
                "run coreai_opt.calibrate(...) first (or enable the observer)"
            )
        return calculator.scale, calculator.zero_point

    def forward(self, x: Tensor) -> Tensor:
        """Observe and/or fake-quantize ``x`` according to the flags (see the module docstring)."""
        if self.export_mode:
            calculator = self.calculator
            return self._fake_quant(x, calculator.scale, calculator.zero_point)
        if x.numel() == 0:  # e.g. a boolean-mask selection that picked nothing: no statistics, quantizes to itself
            return x
        observe, fake_quant = bool(self.observer_enabled), bool(self.fake_quant_enabled)
        if not isinstance(self.calculator, StatefulQParamsCalculatorBase):
            if not fake_quant:
                return x
            scale, zero_point, _ = self.calculator(x)
            return self._fake_quant(x, scale, zero_point)
        if observe and not fake_quant:
            self.observe(x)
            return x
        if observe:
            self.observe(x)
            self.commit()
            return self._fake_quant(x, self.calculator.scale, self.calculator.zero_point)
        if fake_quant:
            scale, zero_point = self._cached_qparams()
            return self._fake_quant(x, scale, zero_point)
        return x

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"name={self.name!r}, dtype={self.spec.dtype}, qscheme={self.spec.qscheme.value}, "
            f"quant_range=[{self.spec.quant_min}, {self.spec.quant_max}], granularity={self.spec.granularity}, "
            f"observer_enabled={bool(self.observer_enabled)}, fake_quant_enabled={bool(self.fake_quant_enabled)}, "
            f"export_mode={self.export_mode}"
        )


FAKE_QUANTIZE: Registry[type[FakeQuantize]] = Registry("fake quantize", FakeQuantize, field="fake_quantize")
FAKE_QUANTIZE.register("default")(FakeQuantize)
