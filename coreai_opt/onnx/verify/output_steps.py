"""The quantization step of a quantized output, per element: what "one step" means for ``verify_onnx``.

* integer dtypes: the ``DequantizeLinear`` scale (per tensor, or broadcast along its axis);
* float8: the spacing of the float8 grid at the value, times the scale. For ``|q| = |x / s|`` in a binade
  ``[2^e, 2^(e+1))`` the spacing is ``2^(e - m)`` with ``m`` mantissa bits (e4m3fn: 3, e5m2: 2); below the
  smallest normal ``2^e_min`` (e4m3fn: -6, e5m2: -14) it is the subnormal spacing ``2^(e_min - m)``. The larger
  of ``|eager|`` and ``|runtime|`` picks the binade, so a value that crossed a binade boundary counts in the
  coarser steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

__all__ = ["OutputStep", "element_steps"]

# float8 dtype -> (mantissa bits, smallest normal exponent)
_FLOAT8_GRID = {TensorProto.FLOAT8E4M3FN: (3, -6), TensorProto.FLOAT8E5M2: (2, -14)}


@dataclass(frozen=True)
class OutputStep:
    """Scale, axis and ONNX dtype of the ``DequantizeLinear`` that produces an output.

    Attributes:
        scale: The scale (0-d, or 1-D per channel), float64.
        axis: The ``DequantizeLinear`` axis (per-channel scales).
        dtype: ONNX ``TensorProto`` dtype of the quantized tensor.
    """

    scale: np.ndarray
    axis: int
    dtype: int

    @property
    def is_float8(self) -> bool:
        """True for float8 outputs (steps vary with the value)."""
        return self.dtype in _FLOAT8_GRID


def _broadcast(scale: np.ndarray, axis: int, reference: np.ndarray) -> np.ndarray:
    if scale.size == 1:
        return scale.reshape(())
    shape = [1] * reference.ndim
    shape[axis % reference.ndim] = -1
    return scale.reshape(shape)


def element_steps(step: OutputStep, reference: np.ndarray, got: np.ndarray) -> np.ndarray:
    """One quantization step per element of ``reference`` (see the module docstring)."""
    scale = _broadcast(step.scale, step.axis, reference)
    if not step.is_float8:
        return scale
    mantissa, min_exponent = _FLOAT8_GRID[step.dtype]
    magnitude = np.maximum(np.abs(reference.astype(np.float64)), np.abs(got.astype(np.float64))) / scale
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    exponent = np.maximum(exponent, min_exponent)
    return scale * np.exp2(exponent - mantissa)
