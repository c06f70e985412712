"""``DynamicFakeQuantize`` (registry key ``"dynamic"``): uint8 activations with qparams from each tensor or token.

Every call computes ``(s, z)`` from the tensor it quantizes (range ``[min(0, min x), max(0, max x)]``, uint8
asymmetric), over the whole tensor (``PerTensor()``: :func:`~coreai_opt.quantization.ops.dynamic_quantize_op.
dynamic_quantize_dequantize`, ONNX ``DynamicQuantizeLinear → DequantizeLinear``) or over each row of the last axis
(``PerToken()``: ``dynamic_quantize_dequantize_per_token``, the same formulas per row; a token's codes then do not
depend on the other tokens of the call, which a KV-cache decoder needs). Nothing is calibrated, so the module has
no qparam buffers and "freezing" it for export only switches a flag.

The spec must be ``dtype="uint8"``, ``qscheme="asymmetric"``, ``granularity=PerTensor()`` or ``PerToken()``,
``qparams_calculator="dynamic"`` (the stateless calculator; :meth:`DynamicFakeQuantize.qparams` returns its
qparams for inspection, identical to the op's for every tensor or row that is not all zeros), which is what
``QuantizerConfig.presets.w8a8_dynamic()`` (``per_token=True``: per token) builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from coreai_opt.quantization.fake_quantize.fake_quantize import FAKE_QUANTIZE, FakeQuantize
from coreai_opt.quantization.ops.dynamic_quantize_op import (
    dynamic_quantize_dequantize,
    dynamic_quantize_dequantize_per_token,
)
from coreai_opt.quantization.spec.granularity import Granularity, PerTensor, PerToken, QuantizationScheme
from coreai_opt.quantization.spec.qparams_calculator import StatelessQParamsCalculatorBase

if TYPE_CHECKING:
    from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = ["DynamicFakeQuantize", "dynamic_activation_spec"]


def dynamic_activation_spec(granularity: Granularity | None = None) -> QuantizationSpec:
    """A spec :class:`DynamicFakeQuantize` accepts: uint8 asymmetric, dynamic calculator.

    ``granularity``: ``PerTensor()`` (default) or ``PerToken()``.
    """
    from coreai_opt.quantization.spec.spec import QuantizationSpec

    granularity = PerTensor() if granularity is None else granularity
    return QuantizationSpec(dtype="uint8", qscheme=QuantizationScheme.ASYMMETRIC, granularity=granularity,
                            range_calculator="minmax", qparams_calculator="dynamic", fake_quantize="dynamic")


@FAKE_QUANTIZE.register("dynamic")
class DynamicFakeQuantize(FakeQuantize):
    """Dynamic per-tensor or per-token uint8 fake quantization (module docstring); exportable without calibration.

    Args:
        spec: A uint8 / asymmetric / per-tensor or per-token spec with ``qparams_calculator="dynamic"``.

    Raises:
        ValueError: any other spec (the message names the field and the accepted value).
    """

    #: This quantizer exports although its calculator is stateless (``FakeQuantize.exports_dynamic``).
    exports_dynamic: ClassVar[bool] = True

    def __init__(self, spec: QuantizationSpec) -> None:
        problems = []
        if spec.dtype != "uint8":
            problems.append(f"dtype={spec.dtype!r} (needs 'uint8')")
        if spec.qscheme is not QuantizationScheme.ASYMMETRIC:
            problems.append(f"qscheme={spec.qscheme.value!r} (needs 'asymmetric')")
        if not isinstance(spec.granularity, (PerTensor, PerToken)):
            problems.append(f"granularity={spec.granularity} (needs PerTensor() or PerToken())")
        if problems:
            raise ValueError(
                "DynamicFakeQuantize exports to ONNX DynamicQuantizeLinear (or its per-token form), which is uint8, "
                "asymmetric and per-tensor or per-token; "
                f"got {', '.join(problems)}. Use coreai_opt.quantization.fake_quantize.dynamic_fake_quantize."
                "dynamic_activation_spec()"
            )
        super().__init__(spec)
        if not isinstance(self.calculator, StatelessQParamsCalculatorBase):
            raise ValueError(
                f"DynamicFakeQuantize needs the stateless qparams calculator, got "
                f"qparams_calculator={spec.qparams_calculator!r}; use qparams_calculator='dynamic'"
            )

    def qparams(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The ``(scale, zero_point)`` the stateless calculator computes for ``x`` (for inspection)."""
        scale, zero_point, _ = self.calculator(x.detach().float())
        return scale, zero_point

    def commit(self) -> None:
        """Nothing to commit: qparams come from every tensor."""
        self._pending = False

    def set_export_mode(self, enabled: bool = True) -> None:
        """Mark the module frozen (observer off, fake-quant on); qparams stay dynamic, nothing is computed."""
        if enabled:
            self.enable_observer(False)
            self.enable_fake_quant(True)
        self.export_mode = bool(enabled)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x`` fake-quantized with its own dynamic qparams (``x`` when fake quantization is off)."""
        if not self.export_mode and not bool(self.fake_quant_enabled):
            return x
        x32 = x if x.dtype == torch.float32 else x.float()
        per_token = isinstance(self.spec.granularity, PerToken)
        y = dynamic_quantize_dequantize_per_token(x32) if per_token else dynamic_quantize_dequantize(x32)
        return y if y.dtype == x.dtype else y.to(x.dtype)
