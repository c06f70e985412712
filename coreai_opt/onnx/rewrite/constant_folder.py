"""An onnxruntime-exact numpy evaluator for the constant chains that compute stored weights and biases.

The arithmetic is onnxruntime's, so a folded value equals what the unfolded graph computes at run time:

* ``QuantizeLinear``: ``q = saturate(round_half_even(x / scale) + zero_point)`` with the division in float32
  (``x / scale``, not ``x * (1 / scale)``); float8 targets divide, saturate to ``±max`` (when ``saturate=1``) and
  round to nearest even through ``ml_dtypes``. Per-tensor, per-axis and blocked (``block_size``) scales.
* ``Div``/``Mul``/``Add``/``Sub`` in the inputs' dtype (IEEE float32, as in onnxruntime), ``Round`` half to even,
  ``Cast``, ``Clip``, ``Identity``, ``Reshape``, ``Gather`` and ``Unsqueeze`` (data movement: exact).
* ``ReduceL2`` (a weight-norm parametrization's ``‖v‖``, ``w = g · v / ‖v‖``): ``sqrt(Σ x²)`` accumulated in
  float64 and rounded once to float32, the correctly rounded norm. onnxruntime's float32 sum (and torch's, in the
  eager model) may differ from it in the last bit, as they differ from each other: this fold is the one step that
  is not bit-identical to the unfolded graph, and a stored weight code can move by one where ``w / s`` sits
  within that last bit of a rounding tie.

Anything else, or a non-float32 ``QuantizeLinear`` input, is not evaluated; :attr:`ConstantFolder.refusal` then
says why when the refusing op had constant inputs. Values the graph lists in ``OnnxGraph.precomputed`` (large
weights ``export_onnx`` quantized chunk by chunk with :func:`evaluate_node`, see
:mod:`coreai_opt.onnx.export.prequantize_weights`) are taken as computed instead of evaluated again.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import axis_and_block

__all__ = ["ConstantFolder", "evaluate_node", "expand_qparam", "dequantize", "FLOAT8", "INTEGER"]

_Arrays = list["np.ndarray | None"]
#: An evaluator returns the value, or a short reason why it does not evaluate these inputs.
_Evaluator = Callable[[onnx.NodeProto, _Arrays], "np.ndarray | str"]

#: Quantized element types QuantizeLinear can produce, as numpy dtypes.
FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
INTEGER = frozenset(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, ml_dtypes.int4, ml_dtypes.uint4))


def expand_qparam(param: np.ndarray, x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """Broadcast a Q/DQ scale or zero point against ``x`` following the ONNX rules."""
    if param.size == 1 and param.ndim <= 1:
        return param.reshape(())
    axis = axis % x.ndim
    if block_size > 0:
        return np.repeat(param, block_size, axis=axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    return param.reshape(shape)


def dequantize(node: onnx.NodeProto, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None) -> np.ndarray:
    """``DequantizeLinear`` in numpy: ``(q - z) * s``, the integer difference exact and the product in float32."""
    axis, block_size = axis_and_block(node)
    s = expand_qparam(scale, q, axis, block_size)
    z = 0.0 if zero_point is None else expand_qparam(zero_point.astype(np.float64), q, axis, block_size)
    return (q.astype(np.float64) - z).astype(np.float32) * s


def _quantize_linear(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | str:
    x, scale = inputs[0], inputs[1]
    zero_point = inputs[2] if len(inputs) > 2 else None
    if x.dtype != np.float32 or scale.dtype != np.float32:
        return f"its QuantizeLinear input is {x.dtype} (the folder quantizes float32 only)"
    axis, block_size = axis_and_block(node)
    if zero_point is not None:
        out_dtype = zero_point.dtype
    else:
        out_type = int(attributes_of(node).get("output_dtype", 0)) or TensorProto.UINT8
        out_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(out_type))
    ratio = x / expand_qparam(scale, x, axis, block_size)  # float32 / float32, correctly rounded like ORT
    if out_dtype in FLOAT8:
        if zero_point is not None and np.any(zero_point.astype(np.float32) != 0):
            return "its float8 QuantizeLinear has a non-zero zero point"
        if int(attributes_of(node).get("saturate", 1)):
            limit = float(ml_dtypes.finfo(out_dtype).max)
            ratio = np.clip(ratio, -limit, limit)
        return ratio.astype(out_dtype)
    if out_dtype not in INTEGER:
        return f"its QuantizeLinear produces {out_dtype}"
    info = ml_dtypes.iinfo(out_dtype)
    zp = 0.0 if zero_point is None else expand_qparam(zero_point.astype(np.float64), x, axis, block_size)
    q = np.rint(ratio).astype(np.float64) + zp
    return np.clip(q, int(info.min), int(info.max)).astype(out_dtype)


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> _Evaluator:
    def evaluate(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray:
        a, b = inputs
        return np.asarray(fn(a, b)).astype(np.result_type(a, b), copy=False)

    return evaluate


def _cast(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | str:
    x = inputs[0]
    target = np.dtype(helper.tensor_dtype_to_np_dtype(int(attributes_of(node)["to"])))
    if target in INTEGER and x.dtype in INTEGER | {np.dtype(np.int32), np.dtype(np.int64)}:
        info = ml_dtypes.iinfo(target)  # integer -> narrower integer (zero points): exact when in range
        values = x.astype(np.int64)
        in_range = values.min(initial=0) >= info.min and values.max(initial=0) <= info.max
        return values.astype(target) if in_range else f"its Cast to {target} is out of range"
    if np.issubdtype(target, np.integer) or target in (np.float32, np.float64):
        return x.astype(target)
    return f"its Cast to {target} is left to onnxruntime"  # float8 casts have saturate / rounding attributes


def _clip(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray:
    x = inputs[0]
    low = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
    high = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if low is not None:
        x = np.maximum(x, low.astype(x.dtype))
    if high is not None:
        x = np.minimum(x, high.astype(x.dtype))
    return x


def _reshape(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray:
    x, shape = inputs
    allow_zero = attributes_of(node).get("allowzero", 0)
    dims = [x.shape[i] if d == 0 and not allow_zero else int(d) for i, d in enumerate(shape)]
    return x.reshape(dims)


def _gather(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | str:
    data, indices = inputs
    axis = int(attributes_of(node).get("axis", 0)) % data.ndim
    size = data.shape[axis]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        return "its Gather has an index out of range"
    return np.take(data, np.where(indices < 0, indices + size, indices).astype(np.int64), axis=axis)


def _axes(attrs: dict, inputs: _Arrays) -> list[int]:
    """The ``axes`` of a node: its attribute (older opsets) or its second input (Unsqueeze >= 13, Reduce* >= 18)."""
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    return [int(a) for a in np.ravel(inputs[1])] if len(inputs) > 1 and inputs[1] is not None else []


def _reduce_l2(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | str:
    x = inputs[0]
    if x.dtype != np.float32:
        return f"its ReduceL2 of {x.dtype} is left to onnxruntime"
    attrs = attributes_of(node)
    axes = tuple(a % x.ndim for a in _axes(attrs, inputs))
    if not axes and attrs.get("noop_with_empty_axes", 0):
        return x
    keepdims = bool(attrs.get("keepdims", 1))
    squares = np.square(x.astype(np.float64))
    return np.sqrt(squares.sum(axis=axes or None, keepdims=keepdims)).astype(np.float32)


def _unsqueeze(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray:
    x = inputs[0]
    attrs = attributes_of(node)
    axes = _axes(attrs, inputs)
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = np.expand_dims(x, axis)
    return x


_EVALUATORS: dict[str, _Evaluator] = {
    "QuantizeLinear": _quantize_linear,
    "Div": _binary(np.divide),
    "Mul": _binary(np.multiply),
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Round": lambda node, inputs: np.rint(inputs[0]),
    "Cast": _cast,
    "Clip": _clip,
    "Identity": lambda node, inputs: inputs[0],
    "Reshape": _reshape,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "ReduceL2": _reduce_l2,
}


def evaluate_node(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | str | None:
    """``node`` on constant ``inputs`` with onnxruntime's arithmetic; a reason string when it refuses them.

    Returns:
        The output, a short reason why these inputs are not evaluated, or None when the op is not supported.
    """
    evaluate = _EVALUATORS.get(node.op_type)
    return None if evaluate is None else evaluate(node, inputs)


class ConstantFolder:
    """Evaluates constant values of one graph on demand (memoised for the folder's lifetime).

    Attributes:
        refusal: Why the last value that could not be computed was refused by an op whose inputs were all
            constant (e.g. a float16 ``QuantizeLinear`` input), None when nothing refused.
    """

    def __init__(self, graph: OnnxGraph) -> None:
        self.graph = graph
        self.refusal: str | None = None
        self._values: dict[str, np.ndarray | None] = {}

    def value(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if the graph computes it from constants only with the supported ops, else None."""
        if not name:
            return None
        if name not in self._values:
            constant = self.graph.constant(name)
            if constant is None:
                constant = self.graph.precomputed.get(name)
            node = self.graph.producer(name)
            if constant is None and node is not None and node.domain in ("", "ai.onnx"):
                constant = self._evaluate(node)
            self._values[name] = constant
        return self._values[name]

    def _evaluate(self, node: onnx.NodeProto) -> np.ndarray | None:
        if node.op_type not in _EVALUATORS or len(node.output) != 1:
            return None
        inputs = [self.value(name) if name else None for name in node.input]
        if any(v is None for name, v in zip(node.input, inputs, strict=True) if name):
            return None
        result = evaluate_node(node, inputs)
        if isinstance(result, str):
            self.refusal = self.refusal or result
            return None
        return result
