"""``BiasFakeQuantize``: int32 bias quantization with the derived scale ``s_b = s_in · s_w``.

Backends run ``acc_int32 = Σ q_in · q_w`` and add an int32 bias expressed in the accumulator's scale
``s_in · s_w``. Simulating that in float::

    s_b = s_in · s_w          (per-tensor, or per-channel along axis 0 when s_w is 1-D)
    y   = clamp(round(b / s_b), −2³¹, 2³¹ − 1) · s_b      (zero point 0)

The module has no tensor state: both scales come from the input and weight quantizers at every call (the graph
passes the two ``FakeQuantize`` modules, whose :meth:`~FakeQuantize.get_qparams` buffers follow every commit, so
the bias stays exact during QAT while the scales move; plain scale tensors are accepted too). Like
``FakeQuantize`` it has a ``fake_quant_enabled`` flag (a plain bool, so export traces no branch on a buffer);
``calibrate`` switches it off so the bias is not quantized with a placeholder or stale input scale. It uses the
same ``coreai_opt::quantize_dequantize`` op (dtype ``"int32"``), whose ONNX translation is an INT32 tensor
feeding ``DequantizeLinear``. No gradient flows to the scales.

For an export, :meth:`BiasFakeQuantize.scale_frozen` computes ``s_b`` once from the current scales and quantizes
with it for the ``with`` block: the traced graph then holds one scale tensor, not the two quantizers' qparams and
the reshape / cast / multiply between them (the same values: the product is the one the forward computes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.ops.quantize_dequantize_op import quantize_dequantize
from coreai_opt.quantization.spec.dtypes import get_dtype_info

__all__ = ["BiasFakeQuantize"]

_INT32 = get_dtype_info("int32", allow_internal=True)


class BiasFakeQuantize(nn.Module):
    """Fake-quantize a bias to int32 with scale ``input_scale · weight_scale``.

    Example:
        >>> bq = BiasFakeQuantize()
        >>> bq(torch.tensor([0.26, -1.0]), torch.tensor(0.1), torch.tensor([0.5, 0.25])).tolist()
        [0.25, -1.0]
    """

    def __init__(self) -> None:
        super().__init__()
        self.name = type(self).__name__
        self.fake_quant_enabled = True

    def enable_fake_quant(self, enabled: bool = True) -> None:
        """Switch fake quantization on or off (off: ``forward`` returns the bias unchanged)."""
        self.fake_quant_enabled = bool(enabled)

    def extra_repr(self) -> str:  # noqa: D102
        return f"name={self.name!r}, fake_quant_enabled={self.fake_quant_enabled}"

    def set_name(self, name: str) -> None:
        """Name this quantizer after the bias it serves, for messages."""
        self.name = name

    def forward(self, bias: Tensor, input_scale: Tensor | FakeQuantize, weight_scale: Tensor | FakeQuantize) -> Tensor:
        """Return the int32-fake-quantized bias (``bias`` itself when fake quantization is off).

        Args:
            bias: 1-D bias of length ``C``.
            input_scale: Per-tensor (0-d or one-element) scale of the layer input, or the input's quantizer
                (its current scale is read).
            weight_scale: Per-tensor (0-d) or per-output-channel (``(C,)``) weight scale, or the weight's
                quantizer.

        Raises:
            ValueError: a per-channel input scale, or a weight scale whose shape does not match the bias.
        """
        frozen = "scale" in self._buffers  # by scale_frozen, which checked the scales
        if not self.fake_quant_enabled:
            if not frozen:
                self._check_input_scale(_scale_of(input_scale))
            return bias
        if frozen:
            scale, zero_point = self._buffers["scale"], self._buffers["zero_point"]
        else:
            scale, zero_point = self.derived_qparams(bias, input_scale, weight_scale)
        b32 = bias if bias.dtype == torch.float32 else bias.float()
        y = quantize_dequantize(
            b32, scale, zero_point, int(_INT32.quant_min), int(_INT32.quant_max), 0, 0, "int32"
        )
        return y if y.dtype == bias.dtype else y.to(bias.dtype)

    def derived_qparams(self, bias: Tensor, input_scale: Tensor | FakeQuantize,
                        weight_scale: Tensor | FakeQuantize) -> tuple[Tensor, Tensor]:
        """``(s_b, 0)`` for ``bias``: ``s_b = s_in · s_w`` in float32, zero point int32 zeros of its shape.

        Raises:
            ValueError: a per-channel input scale, or a weight scale whose shape does not match the bias.
        """
        input_scale, weight_scale = _scale_of(input_scale), _scale_of(weight_scale)
        self._check_input_scale(input_scale)
        if weight_scale.dim() > 1 or (weight_scale.dim() == 1 and weight_scale.shape[0] != bias.shape[0]):
            raise ValueError(
                f"{self.name}: weight scale of shape {tuple(weight_scale.shape)} cannot scale a bias of shape "
                f"{tuple(bias.shape)}; int32 bias needs a per-tensor or per-output-channel (axis 0) weight scale"
            )
        scale = (input_scale.reshape(()).float() * weight_scale.float()).detach()
        return scale, torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)

    def _check_input_scale(self, input_scale: Tensor) -> None:
        if input_scale.numel() != 1:
            raise ValueError(
                f"{self.name}: int32 bias needs a per-tensor input scale, got shape {tuple(input_scale.shape)}; "
                "quantize the layer input per-tensor or leave the bias in float"
            )

    @contextmanager
    def scale_frozen(self, bias: Tensor, input_scale: Tensor | FakeQuantize,
                     weight_scale: Tensor | FakeQuantize) -> Iterator[None]:
        """Quantize with ``derived_qparams`` computed now, for the ``with`` block (an export's trace).

        They are the non-persistent buffers ``scale`` and ``zero_point`` inside the block (so a file names them
        ``<bias quantizer>.scale``), gone after it. The two quantizers are not read inside the block, so a scale they
        commit meanwhile is not followed: use it only around a trace of a converted model, whose qparams are frozen.
        """
        with torch.no_grad():
            scale, zero_point = (t.clone() for t in self.derived_qparams(bias, input_scale, weight_scale))
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero_point", zero_point, persistent=False)
        try:
            yield
        finally:
            del self._buffers["scale"], self._buffers["zero_point"]
            self._non_persistent_buffers_set.difference_update({"scale", "zero_point"})


def _scale_of(source: Tensor | FakeQuantize) -> Tensor:
    return source.get_qparams().scale if isinstance(source, FakeQuantize) else source
