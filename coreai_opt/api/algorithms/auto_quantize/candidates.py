"""The per-layer formats ``auto_quantize`` chooses from, and the config entry each one writes.

================ ============================================================= ===============================
candidate        weight / input activation of the layer                        onnxruntime kernel
================ ============================================================= ===============================
``static``       int8 per-channel / uint8 asymmetric per-tensor, calibrated    ``QGemm`` / ``QLinearConv``
                 range (the calculator ``search_calibration`` picked)
``dynamic``      int8 per-channel / uint8 per-tensor from every tensor at run  ``DynamicQuantizeMatMul``
                 time (linears only)
``int8_compute`` int8 per-channel (stored in K blocks of at most 256) / int8 per ``MatMulNBits`` (``bits=8``,
                 row and per K block (``amax / 127``) at run time, by the      ``accuracy_level=4``)
                 kernel itself, emulated in eager (linears only;
                 ``presets.w8(compute="int8")``)
``int16``        int8 per-channel / uint16 asymmetric per-tensor, calibrated   float kernel between
                                                                               16-bit ``Q → DQ``
``float``        float / float                                                 float ``Gemm`` / ``Conv``
================ ============================================================= ===============================

``int8_compute`` is the per-token format: each row of the activation gets its own scale per block of ``K``, so
an outlier token or channel costs only its own block's resolution, where ``dynamic`` shares one scale across the
whole tensor. A linear whose input is already an 8-bit quantized tensor (the requantized output of a ``static``
layer) runs no ``MatMulNBits``: the search never gives it ``int8_compute`` behind a ``static`` producer.

A *unit* is a set of layers that read the same input tensor (attention's q / k / v projections, a ResNet block's
first conv and its downsample): one tensor has one quantizer, so its readers take one candidate together.
SmoothQuant migration (``static`` or ``dynamic`` on a smoothed input) is decided per site before the search, by
``smooth_quant``'s held-out α search; the report shows each unit's α.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreai_opt.config import QuantizerConfig
from coreai_opt.config.op_config import OpConfig
from coreai_opt.config.presets import ACTIVATION_RANGES
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import dynamic_activation_spec
from coreai_opt.quantization.spec import QuantizationSpec

__all__ = ["CANDIDATES", "Candidate", "candidate_op_config", "kernel_kind"]


@dataclass(frozen=True)
class Candidate:
    """One format.

    Attributes:
        name: Registry key (``"static"``, ``"dynamic"``, ``"int8_compute"``, ``"int16"``, ``"float"``).
        layer_kinds: Layer kinds (``"linear"``, ``"conv"``) the format applies to.
        calibrated: True when its activation qparams come from calibration (needs the range calculator).
    """

    name: str
    layer_kinds: frozenset[str]
    calibrated: bool


#: Candidate name -> :class:`Candidate`, in the order the search prefers on equal cost and error.
CANDIDATES: dict[str, Candidate] = {
    "static": Candidate("static", frozenset({"linear", "conv"}), True),
    "dynamic": Candidate("dynamic", frozenset({"linear"}), False),
    "int8_compute": Candidate("int8_compute", frozenset({"linear"}), False),
    "int16": Candidate("int16", frozenset({"linear", "conv"}), True),
    "float": Candidate("float", frozenset({"linear", "conv"}), False),
}


@public_api
def kernel_kind(candidate: str, layer_kind: str) -> str:
    """The cost-table kernel kind of ``candidate`` on a ``layer_kind`` layer (``"linear_static"``)."""
    suffix = "static" if candidate == "static" else candidate
    return f"{layer_kind}_{suffix}"


def _static_activation(dtype_preset: str, range_calculator: str) -> QuantizationSpec:
    base = QuantizerConfig.presets.get(dtype_preset)().activation
    range_name, qparams = ACTIVATION_RANGES[range_calculator]
    return base.model_copy(update={"range_calculator": range_name, "qparams_calculator": qparams})


@public_api
def candidate_op_config(candidate: str, range_calculator: str = "minmax") -> OpConfig | None:
    """The ``module_name`` entry that puts a layer in ``candidate`` (None: float).

    Args:
        candidate: A key of :data:`CANDIDATES`.
        range_calculator: Activation range calculator of the calibrated formats (a key of
            ``coreai_opt.config.presets.ACTIVATION_RANGES``).

    Raises:
        ValueError: unknown candidate or range calculator (the valid names are listed).

    Example:
        >>> candidate_op_config("int16").activation.dtype
        'uint16'
    """
    if candidate not in CANDIDATES:
        raise ValueError(f"unknown candidate {candidate!r}; valid candidates: {', '.join(CANDIDATES)}")
    if range_calculator not in ACTIVATION_RANGES:
        raise ValueError(f"unknown range calculator {range_calculator!r}; valid: {', '.join(ACTIVATION_RANGES)}")
    if candidate == "float":
        return None
    if candidate == "int8_compute":
        return OpConfig(weight=QuantizerConfig.presets.w8(compute="int8").weight, activation=None)
    weight = QuantizerConfig.presets.w8a8().weight
    if candidate == "dynamic":
        return OpConfig(weight=weight, activation=dynamic_activation_spec())
    preset = "w8a8" if candidate == "static" else "w8a16"
    return OpConfig(weight=weight, activation=_static_activation(preset, range_calculator))
