"""The table of quantized dtypes: integer range, eager storage dtype, ONNX element type and minimum opset.

================  ==============  ===============  ===================  ============
name              quant range     torch storage    ONNX element type    min opset
================  ==============  ===============  ===================  ============
int8              [-128, 127]     torch.int8       INT8                 13
uint8             [0, 255]        torch.uint8      UINT8                13
int16             [-32768, 32767] torch.int16      INT16                21
uint16            [0, 65535]      torch.uint16     UINT16               21
int4              [-8, 7]         torch.int8       INT4                 21
uint4             [0, 15]         torch.uint8      UINT4                21
float8_e4m3fn     ±448            float8_e4m3fn    FLOAT8E4M3FN         19
float8_e5m2       ±57344          float8_e5m2      FLOAT8E5M2           19
int32 (internal)  [-2^31, 2^31-1] torch.int32      INT32                13
================  ==============  ===============  ===================  ============

``int32`` is only used for biases whose scale is derived as ``s_in · s_w``; users cannot pick it in a
spec. The minimum opsets are the ones onnxruntime's CPU provider runs (see ``docs/ARCHITECTURE.md``):
int16/uint16/int4/uint4 QuantizeLinear needs opset 21, float8 needs 19; per-block (``block_size``)
quantization needs 21 whatever the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

__all__ = ["QuantDtype", "SUPPORTED_DTYPES", "get_dtype_info"]


@dataclass(frozen=True)
class QuantDtype:
    """One row of the dtype table.

    Attributes:
        name: Canonical name, e.g. ``"int8"``.
        quant_min: Smallest representable value (an int, or a float for float8).
        quant_max: Largest representable value.
        storage_dtype: torch dtype that holds quantized values in eager mode.
        onnx_type: ``onnx.TensorProto`` element type of the zero point / quantized tensor.
        is_float: True for the float8 formats (no zero point, scale = max_abs / finfo.max).
        bits: Bit width.
        min_opset: Lowest ONNX opset whose QuantizeLinear/DequantizeLinear onnxruntime runs for it.
    """

    name: str
    quant_min: int | float
    quant_max: int | float
    storage_dtype: torch.dtype
    onnx_type: int
    is_float: bool
    bits: int
    min_opset: int

    @property
    def is_signed(self) -> bool:
        """True when the range contains negative values."""
        return self.quant_min < 0


def _int(name: str, bits: int, signed: bool, storage: torch.dtype, onnx_type: int, opset: int) -> QuantDtype:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return QuantDtype(name, lo, hi, storage, onnx_type, False, bits, opset)


def _float8(name: str, storage: torch.dtype, onnx_type: int) -> QuantDtype:
    fmax = float(torch.finfo(storage).max)
    return QuantDtype(name, -fmax, fmax, storage, onnx_type, True, 8, 19)


_TABLE: dict[str, QuantDtype] = {
    d.name: d
    for d in (
        _int("int8", 8, True, torch.int8, TensorProto.INT8, 13),
        _int("uint8", 8, False, torch.uint8, TensorProto.UINT8, 13),
        _int("int16", 16, True, torch.int16, TensorProto.INT16, 21),
        _int("uint16", 16, False, torch.uint16, TensorProto.UINT16, 21),
        _int("int4", 4, True, torch.int8, TensorProto.INT4, 21),
        _int("uint4", 4, False, torch.uint8, TensorProto.UINT4, 21),
        _float8("float8_e4m3fn", torch.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
        _float8("float8_e5m2", torch.float8_e5m2, TensorProto.FLOAT8E5M2),
    )
}

# Internal: int32 biases with derived scale s_in * s_w (DequantizeLinear only in ONNX).
_INTERNAL: dict[str, QuantDtype] = {
    "int32": _int("int32", 32, True, torch.int32, TensorProto.INT32, 13),
}

#: The dtype names a :class:`~coreai_opt.quantization.spec.QuantizationSpec` accepts.
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_TABLE)

_TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.uint16: "uint16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int32: "int32",
}
for _name, _attr in (("int4", "int4"), ("uint4", "uint4")):
    if hasattr(torch, _attr):
        _TORCH_TO_NAME[getattr(torch, _attr)] = _name


def get_dtype_info(dtype: str | torch.dtype, *, allow_internal: bool = False) -> QuantDtype:
    """Look up a quantized dtype by name (``"int8"``) or torch dtype (``torch.int8``).

    Args:
        dtype: Name or torch dtype.
        allow_internal: Also accept ``"int32"`` (derived bias quantization).

    Returns:
        The table row.

    Raises:
        ValueError: Unknown dtype; the message lists the valid names.

    Example:
        >>> get_dtype_info("int4").quant_min, get_dtype_info(torch.uint8).quant_max
        (-8, 255)
    """
    name = _TORCH_TO_NAME.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else dtype
    if isinstance(name, str):
        if name in _TABLE:
            return _TABLE[name]
        if allow_internal and name in _INTERNAL:
            return _INTERNAL[name]
    valid = ", ".join(SUPPORTED_DTYPES)
    raise ValueError(f"unsupported quantized dtype {dtype!r}; valid dtypes are: {valid}")
