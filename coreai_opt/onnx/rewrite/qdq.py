"""``QdqView``: one ``QuantizeLinear`` / ``DequantizeLinear`` node decoded once.

The rules ask the same questions of every Q/DQ node: which tensors are its data, scale and zero point, are they
constants, what are the axis and block size, what is the quantized element type (``int4``, ``float8e4m3fn``, ...),
is it per-tensor, per-axis or blocked. The answers follow the ONNX operator definitions:

* quantized type of a ``DequantizeLinear``: its constant data's type, else its constant zero point's type;
  of a ``QuantizeLinear``: its constant zero point's type, else ``output_dtype`` (opset 21), else ``uint8``;
* granularity: ``blocked`` when ``block_size > 0``, else ``per_tensor`` when the scale has one element
  (shape ``()`` or ``[1]``), else ``per_axis`` along ``axis`` (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["QdqView", "QuantType", "QUANT_TYPES", "axis_and_block", "FLOAT8_TYPES"]

_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


@dataclass(frozen=True)
class QuantType:
    """What a quantized element type is: bits, signedness, float or integer."""

    name: str
    bits: int
    signed: bool
    is_float: bool


#: ONNX element type -> :class:`QuantType`, for every type a Q/DQ node quantizes to (INT32: derived biases).
QUANT_TYPES: dict[int, QuantType] = {
    TensorProto.INT8: QuantType("int8", 8, True, False),
    TensorProto.UINT8: QuantType("uint8", 8, False, False),
    TensorProto.INT16: QuantType("int16", 16, True, False),
    TensorProto.UINT16: QuantType("uint16", 16, False, False),
    TensorProto.INT4: QuantType("int4", 4, True, False),
    TensorProto.UINT4: QuantType("uint4", 4, False, False),
    TensorProto.INT32: QuantType("int32", 32, True, False),
    TensorProto.FLOAT8E4M3FN: QuantType("float8e4m3fn", 8, True, True),
    TensorProto.FLOAT8E4M3FNUZ: QuantType("float8e4m3fnuz", 8, True, True),
    TensorProto.FLOAT8E5M2: QuantType("float8e5m2", 8, True, True),
    TensorProto.FLOAT8E5M2FNUZ: QuantType("float8e5m2fnuz", 8, True, True),
}
FLOAT8_TYPES = frozenset(t for t, info in QUANT_TYPES.items() if info.is_float)


def axis_and_block(node: onnx.NodeProto) -> tuple[int, int]:
    """``(axis, block_size)`` of a Q/DQ node as written (defaults 1 and 0; the axis is not normalised)."""
    axis, block_size = 1, 0
    for attr in node.attribute:
        if attr.name == "axis":
            axis = int(attr.i)
        elif attr.name == "block_size":
            block_size = int(attr.i)
    return axis, block_size


def _element_type(value: np.ndarray | None) -> int | None:
    return None if value is None else int(helper.np_dtype_to_tensor_dtype(value.dtype))


@dataclass(frozen=True)
class QdqView:
    """A decoded ``QuantizeLinear`` / ``DequantizeLinear`` (build with :meth:`of`).

    Attributes:
        node: The node.
        data: Name of input 0 (float input of a Q, quantized input of a DQ).
        scale_name: Name of the scale input.
        zero_point_name: Name of the zero-point input, None when absent.
        scale: The scale when it is a constant, else None.
        zero_point: The zero point when it is a constant, else None (also when absent).
        axis: The ``axis`` attribute (default 1), as written.
        block_size: The ``block_size`` attribute (0: not blocked).
        quant_type: ONNX element type of the quantized side, None when no constant tells it.
        data_is_constant: Whether input 0 is a constant (a stored weight).
    """

    node: onnx.NodeProto
    data: str
    scale_name: str
    zero_point_name: str | None
    scale: np.ndarray | None
    zero_point: np.ndarray | None
    axis: int
    block_size: int
    quant_type: int | None
    data_is_constant: bool

    @classmethod
    def of(cls, node: onnx.NodeProto | None, graph: OnnxGraph) -> QdqView | None:
        """Decode ``node``; None unless it is a default-domain ``QuantizeLinear`` / ``DequantizeLinear``."""
        if node is None or node.op_type not in _QDQ_OPS or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            return None
        zero_point_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        zero_point = graph.constant(zero_point_name) if zero_point_name else None
        data_value = graph.constant(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if node.op_type == "DequantizeLinear":
            quant_type = _element_type(data_value if data_value is not None else zero_point)
        elif zero_point_name:
            quant_type = _element_type(zero_point)
        else:
            output_dtype = next((int(a.i) for a in node.attribute if a.name == "output_dtype"), 0)
            quant_type = output_dtype or TensorProto.UINT8
        axis, block_size = axis_and_block(node)
        data_is_constant = data_value is not None or graph.constant(node.input[0]) is not None
        return cls(node, node.input[0], node.input[1], zero_point_name, graph.constant(node.input[1]), zero_point,
                   axis, block_size, quant_type, data_is_constant)

    @property
    def is_dequantize(self) -> bool:
        """True for ``DequantizeLinear``."""
        return self.node.op_type == "DequantizeLinear"

    @property
    def type_info(self) -> QuantType | None:
        """Bits / signedness of :attr:`quant_type` (None when unknown or not a quantized type)."""
        return QUANT_TYPES.get(self.quant_type) if self.quant_type is not None else None

    @property
    def type_name(self) -> str:
        """``"int8"``, ``"float8e4m3fn"``, ... (``"unknown"`` when no constant tells)."""
        info = self.type_info
        return info.name if info is not None else "unknown"

    @property
    def granularity(self) -> str | None:
        """``"per_tensor"``, ``"per_axis"`` or ``"blocked"``; None when the scale is not a constant."""
        if self.block_size > 0:
            return "blocked"
        if self.scale is None:
            return None
        return "per_tensor" if self.scale.size == 1 and self.scale.ndim <= 1 else "per_axis"

    @property
    def has_constant_qparams(self) -> bool:
        """Scale constant, and zero point absent or constant."""
        return self.scale is not None and (self.zero_point_name is None or self.zero_point is not None)

    @property
    def zero_point_is_zero(self) -> bool:
        """Zero point absent, or a constant whose every element is 0."""
        if self.zero_point_name is None:
            return True
        return self.zero_point is not None and not np.any(self.zero_point.astype(np.float64))
