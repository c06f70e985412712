"""Whose tensor a fixed activation range describes: the op that produces it, never the op that reads it.

A spec's ``float_range`` is a statement about values, so it belongs to one tensor. The config resolves one
activation spec per op, and an op's activation spec serves two kinds of quantizer: the op's **output** (the tensor
the op produces) and the **input edges** it asks for (tensors other ops produced). A range configured on an op
(``set_op_kind("sigmoid", OpConfig(activation=spec_with_range_0_1))``) describes its output; applied to its input
edge it would clamp the pre-activation to [0, 1] — a squeeze-excite gate's logits, measured at 36.6 → 22.1 dB on a
small SE network — and no error would say so. So an input-edge request takes the reader's spec with the range of
the tensor it reads, the one configured for the **producer** (:func:`edge_request_spec`):

* an op output with no configured range: the request has none; the edge is calibrated (and usually served by the
  producer's own output quantizer, which the producer's spec decides anyway);
* a graph input: the spec resolved for the ``input`` node, i.e. the global activation spec, so a global
  ``float_range`` (data-free quantization with known ranges) still fixes the graph inputs;
* a producer with a range and a reader whose spec differs in dtype (an int16 reader of a sigmoid): the reader's
  requantizer keeps the producer's range, since it quantizes the same values.

Softmax's pattern range (:func:`fixed_range_spec`) is the output's too; readers asking for the configured spec
share it through ``QuantSpec.refines``.
"""

from __future__ import annotations

import math

import torch

from coreai_opt.quantization.spec import QuantizationSpec
from coreai_opt.quantization.spec.qparams_math import compute_qparams

__all__ = ["edge_request_spec", "fixed_range_spec", "power_of_two_step"]


def edge_request_spec(reader: QuantizationSpec, produced: QuantizationSpec | None) -> QuantizationSpec:
    """The spec a reader asks for on an input edge: its own, with the range configured for the tensor's producer.

    Args:
        reader: The activation spec resolved for the reading op.
        produced: The activation spec resolved for the producing node (``None``: none configured).

    Returns:
        ``reader`` with ``float_range = produced.float_range`` (``None`` when no producer spec is configured, or
        when the reader's spec cannot hold a range: a stateless calculator recomputes it from every tensor).
    """
    float_range = None if produced is None else produced.float_range
    if reader.float_range == float_range:
        return reader
    try:
        return QuantizationSpec.from_dict({**reader.to_dict(), "float_range": _listed(float_range)})
    except ValueError:
        return reader.model_copy(update={"float_range": None})


def _listed(float_range: tuple[float | None, float | None] | None) -> list[float | None] | None:
    return None if float_range is None else list(float_range)


def power_of_two_step(spec: QuantizationSpec, float_range: tuple[float, float]) -> tuple[float, float]:
    """Shrink ``float_range``'s upper end so that an integer dtype's step is exactly a power of two.

    onnxruntime's ``QLinearSoftmax`` requantizes with the factor ``floor(1 / y_scale)``: for ``[0, 1]`` in
    uint8, ``y_scale = float32(1/255)`` and ``1 / y_scale = 254.99998``, so every probability would come out
    scaled by 254/255 (one step off near 1) while the eager model rounds ``p / y_scale``. With
    ``y_scale = 2^-8`` (range ``[0, 255/256]``) the factor is exactly 256 and both compute the same grid; the
    largest probability loses at most one step of 1/256 to clamping. Float dtypes keep the range.

    Math: with ``lo = 0`` the step is ``s(hi) = hi / L`` for a dtype constant ``L`` (255 for asymmetric uint8,
    127.5 for symmetric int8), so ``hi' = 2^floor(log2(hi / L)) · L`` gives the power-of-two step
    ``s(hi') = 2^floor(log2(hi / L))``. The result is checked; if it is not exact the range is kept.
    """
    if spec.dtype_info.is_float or float_range[0] != 0.0:
        return float_range
    high = float_range[1]

    def step_of(upper: float) -> float:
        return float(compute_qparams(torch.tensor(0.0), torch.tensor(upper), spec.dtype_info, spec.qscheme).scale)

    levels = round(2.0 * high / step_of(high)) / 2.0  # 255 (asymmetric uint8) or 127.5 (symmetric int8): exact
    target = 2.0 ** math.floor(math.log2(high / levels))
    upper = target * levels  # a power of two times a (half-)integer: exact in float32
    return (0.0, upper) if step_of(upper) == target else float_range


def fixed_range_spec(spec: QuantizationSpec, float_range: tuple[float, float], power_of_two: bool = False
                     ) -> QuantizationSpec:
    """``spec`` with an op pattern's known output range (softmax's [0, 1]) unless the config already set one.

    Args:
        spec: The op's configured activation spec.
        float_range: The pattern's range.
        power_of_two: Shrink the upper end to a power-of-two integer step (:func:`power_of_two_step`).

    Returns:
        The spec with the range, or ``spec`` unchanged when it has a range or cannot hold one (stateless).
    """
    if spec.float_range is not None:
        return spec
    if power_of_two:
        float_range = power_of_two_step(spec, float_range)
    try:
        return QuantizationSpec.from_dict({**spec.to_dict(), "float_range": list(float_range)})
    except ValueError:  # e.g. a stateless calculator: keep observing
        return spec
