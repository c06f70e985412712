"""Pure qparams math: from a float range ``[min_val, max_val]`` to ``(scale, zero_point, minval)``.

Every formula below works elementwise on tensors of the qparam shape, in float32. Let
``min⁻ = min(min_val, 0)``, ``max⁺ = max(max_val, 0)`` (the range always contains 0, so 0 is exactly
representable), ``max_abs = max(-min⁻, max⁺)``, ``eps = torch.finfo(torch.float32).eps`` and
``(qmin, qmax) = quant_range(dtype, qscheme)``.

=============================  ====================================  =====================================
scheme                         scale                                 zero point
=============================  ====================================  =====================================
symmetric (int)                ``max_abs / ((qmax - qmin) / 2)``     ``(qmin + qmax + 1) // 2``
symmetric_with_clipping (int)  same, over the narrowed range         same (0 for signed dtypes)
asymmetric (int)               ``(max⁺ - min⁻) / (qmax - qmin)``     ``clamp(qmin - round(min⁻ / s))``
float8 (either symmetric)      ``max_abs / finfo(dtype).max``        none
=============================  ====================================  =====================================

Examples: int8 symmetric divides by 127.5 over ``[-128, 127]``; int8 symmetric_with_clipping divides by
127 over ``[-127, 127]``; uint8 symmetric has ``zp = 128``. Every scale is floored at ``eps``, so an
all-zero range gives the finite scale ``eps`` (documented floor, not a silent repair). ``minval`` is the
float value of ``qmin``: ``minval = (qmin - zp) · scale``.

Range bounds that are ``±inf`` (a row in which no finite value was observed) are treated as 0, i.e. a
zero-width range; NaN bounds are an error.

Overflow safety (values near ``FLT_MAX = finfo(float32).max``; bit-identical to the plain float32 formulas for
every other range):

* the bounds are first clamped, in their own precision (float64 histogram bounds included), to
  ``±L`` with :func:`range_limit` ``L`` chosen so that every point of the quantization grid,
  ``(q - zp) · scale`` for ``q`` in ``[qmin, qmax]``, is finite in float32 (e.g. int8 symmetric:
  ``L = FLT_MAX · 127.5 / 128``, asymmetric: ``L = FLT_MAX · N / (N + 1)`` with ``N = qmax - qmin``, each less a
  ``2⁻²⁰`` relative margin for rounding);
* the asymmetric width ``max⁺ − min⁻`` of such a range can exceed ``FLT_MAX``; where the float32 width is
  not finite it is computed in float64 (exact) and the scale rounded to float32 once.

So every scale is finite and ``>= eps`` and every ``minval`` finite; :class:`~coreai_opt.errors.QParamsRangeError`
is raised (by the stateful calculators, naming the quantizer) if a result is not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from coreai_opt.errors import QParamsRangeError
from coreai_opt.quantization.spec.dtypes import QuantDtype
from coreai_opt.quantization.spec.granularity import QuantizationScheme

__all__ = ["QParams", "quant_range", "range_limit", "compute_qparams", "SCALE_EPS", "FLOAT32_MAX"]

#: Smallest scale ever produced: ``torch.finfo(torch.float32).eps`` (also for fp16/bf16 models).
SCALE_EPS: float = float(torch.finfo(torch.float32).eps)
#: Largest finite float32.
FLOAT32_MAX: float = float(torch.finfo(torch.float32).max)
# Relative margin of range_limit for the float32 rounding of scale, zero point and minval.
_LIMIT_MARGIN = 2.0**-20


class QParams(NamedTuple):
    """Quantization parameters of one quantizer, all with the qparam shape.

    Attributes:
        scale: float32, strictly positive.
        zero_point: int32 for integer dtypes, ``None`` for float8.
        minval: float32 value of ``qmin`` (``(qmin - zp) · scale``), ``None`` for float8.
    """

    scale: Tensor
    zero_point: Tensor | None
    minval: Tensor | None


def quant_range(dtype_info: QuantDtype, qscheme: QuantizationScheme | str) -> tuple[int | float, int | float]:
    """Return the ``(qmin, qmax)`` a quantizer clamps to.

    ``symmetric_with_clipping`` narrows a signed range to ``[-qmax, qmax]`` (int8: ``[-127, 127]``) so that
    it is symmetric around 0; unsigned and float8 ranges are unchanged.

    Args:
        dtype_info: Row of the dtype table (:func:`~coreai_opt.quantization.spec.dtypes.get_dtype_info`).
        qscheme: Quantization scheme.

    Returns:
        ``(qmin, qmax)``: ints for integer dtypes, floats (``±finfo.max``) for float8.

    Example:
        >>> from coreai_opt.quantization.spec.dtypes import get_dtype_info
        >>> quant_range(get_dtype_info("int8"), "symmetric_with_clipping")
        (-127, 127)
    """
    scheme = QuantizationScheme(qscheme)
    qmin, qmax = dtype_info.quant_min, dtype_info.quant_max
    if scheme is QuantizationScheme.SYMMETRIC_WITH_CLIPPING and dtype_info.is_signed and not dtype_info.is_float:
        return -qmax, qmax
    return qmin, qmax


def range_limit(dtype_info: QuantDtype, qscheme: QuantizationScheme | str) -> float:
    """Largest ``|bound|`` whose quantization grid stays finite in float32 (see the module docstring).

    Returns:
        ``L`` as a float32-representable Python float.

    Example:
        >>> from coreai_opt.quantization.spec.dtypes import get_dtype_info
        >>> range_limit(get_dtype_info("int8"), "symmetric") < FLOAT32_MAX
        True
    """
    scheme = QuantizationScheme(qscheme)
    if dtype_info.is_float:
        ratio = 1.0  # grid extreme = finfo(dtype).max · scale = max_abs
    else:
        qmin, qmax = quant_range(dtype_info, scheme)
        levels = float(qmax - qmin)
        if scheme is QuantizationScheme.ASYMMETRIC:
            ratio = levels / (levels + 1.0)  # |grid end| <= |bound| + scale / 2 and scale <= 2L / N
        else:
            zero_point = (qmin + qmax + 1) // 2
            ratio = (levels / 2.0) / max(zero_point - qmin, qmax - zero_point)
    limit = torch.tensor(FLOAT32_MAX * ratio * (1.0 - _LIMIT_MARGIN), dtype=torch.float64).float()
    return float(limit)


def _finite_or_zero(bound: Tensor, what: str, limit: float) -> Tensor:
    """Check for NaN, treat ``±inf`` as 0, clamp to ``±limit`` (in the bound's precision), return float32."""
    if not bound.is_floating_point() or bound.dtype in (torch.float16, torch.bfloat16):
        bound = bound.float()
    if bool(torch.isnan(bound).any()):
        raise QParamsRangeError(
            f"compute_qparams got NaN in {what}; range statistics must ignore NaN (check the range calculator) "
            "or pass a float_range"
        )
    bound = torch.where(torch.isinf(bound), torch.zeros_like(bound), bound)
    return torch.clamp(bound, -limit, limit).float()


def compute_qparams(
    min_val: Tensor | float,
    max_val: Tensor | float,
    dtype_info: QuantDtype,
    qscheme: QuantizationScheme | str,
) -> QParams:
    """Compute ``(scale, zero_point, minval)`` from a float range (formulas in the module docstring).

    Args:
        min_val: Observed minimum per qparam group (any shape; ``max_val`` must broadcast to it).
        max_val: Observed maximum per qparam group.
        dtype_info: Target dtype.
        qscheme: Quantization scheme. Float8 dtypes must use a symmetric scheme.

    Returns:
        :class:`QParams` with float32 ``scale``/``minval`` and int32 ``zero_point`` (``None`` for float8).

    Raises:
        QParamsRangeError: NaN bounds (a ``ValueError``).
        ValueError: An asymmetric scheme with a float8 dtype.

    Example:
        >>> from coreai_opt.quantization.spec.dtypes import get_dtype_info
        >>> p = compute_qparams(torch.tensor(-1.0), torch.tensor(3.0), get_dtype_info("uint8"), "asymmetric")
        >>> round(p.scale.item() * 255, 5), p.zero_point.item()
        (4.0, 64)
    """
    scheme = QuantizationScheme(qscheme)
    limit = range_limit(dtype_info, scheme)
    mn = _finite_or_zero(torch.as_tensor(min_val).detach(), "min_val", limit)
    mx = _finite_or_zero(torch.as_tensor(max_val).detach(), "max_val", limit)
    min_neg = torch.clamp(mn, max=0.0)
    max_pos = torch.clamp(mx, min=0.0)
    max_abs = torch.maximum(-min_neg, max_pos)
    qmin, qmax = quant_range(dtype_info, scheme)

    if dtype_info.is_float:
        if scheme is QuantizationScheme.ASYMMETRIC:
            raise ValueError(
                f"dtype {dtype_info.name!r} is a float format and has no zero point; use qscheme='symmetric'"
            )
        scale = torch.clamp(max_abs / float(dtype_info.quant_max), min=SCALE_EPS)
        return QParams(scale, None, None)

    if scheme is QuantizationScheme.ASYMMETRIC:
        width = max_pos - min_neg
        scale = width / float(qmax - qmin)
        if not bool(torch.isfinite(width).all()):  # only near FLT_MAX: the width in float64, rounded once
            wide = (max_pos.double() - min_neg.double()) / float(qmax - qmin)
            scale = torch.where(torch.isfinite(width), scale, wide.float())
        scale = torch.clamp(scale, min=SCALE_EPS)
        zero_point = torch.clamp(qmin - torch.round(min_neg / scale), qmin, qmax).to(torch.int32)
    else:
        scale = torch.clamp(max_abs / ((qmax - qmin) / 2.0), min=SCALE_EPS)
        zero_point = torch.full_like(scale, (qmin + qmax + 1) // 2, dtype=torch.int32)
    minval = (qmin - zero_point).float() * scale
    return QParams(scale, zero_point, minval)
