"""ONNX post-pass: store constant weights and biases quantized (integer / float8 initializer -> DequantizeLinear).

The spec layer's translation emits ``QuantizeLinear -> DequantizeLinear`` for every quantizer, including the ones on
weights, and ``DequantizeLinear(Cast(Round(b / (s_in * s_w))))`` for int32 biases. When the quantized input is a
constant (an initializer or a ``Constant`` node), everything upstream of the ``DequantizeLinear`` can be computed
once. This pass evaluates those constant chains with numpy and replaces them by one initializer of the quantized
type (INT8, UINT8, INT16, UINT16, INT4, UINT4, FLOAT8E4M3FN, FLOAT8E5M2, INT32) feeding the ``DequantizeLinear``;
the scale and zero-point inputs of that ``DequantizeLinear`` are folded the same way. The float weights, now
unused, are dropped, so the file shrinks to about a quarter (int8) or an eighth (int4) of its fp32 size.

The arithmetic is onnxruntime's, so the folded model computes exactly what the unfolded one did:

* ``QuantizeLinear``: ``q = saturate(round_half_even(x / scale) + zero_point)`` with the division in float32
  (``x / scale``, not ``x * (1 / scale)``); float8 targets divide, saturate to ``±max`` (when ``saturate=1``) and
  round to nearest even through ``ml_dtypes``. Per-tensor, per-axis and blocked (``block_size``) scales.
* ``Div``/``Mul``/``Add``/``Sub`` in the inputs' dtype (IEEE float32, as in onnxruntime), ``Round`` half to even,
  ``Cast``, ``Clip``, ``Identity``, ``Reshape``.

A chain containing anything else, or a non-float32 ``QuantizeLinear`` input, is left as it is.

All-zero zero points of blocked constant weights (symmetric quantization) are dropped: the input is optional and
defaults to 0, and it would cost one value per block (onnxruntime's QGemm fusion needs the per-channel ones).

Narrow ranges (int8 ``[-127, 127]``): the translation clamps them in float after ``DequantizeLinear``
(``Clip``, or ``Max -> Min`` for per-channel bounds). For a constant weight that clamp moves into the stored
integers, so onnxruntime sees ``DequantizeLinear -> Conv`` and can fuse it; the rewrite is verified to reproduce the
clamped floats exactly and skipped otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, readers_of

__all__ = ["fold_quantized_weights"]

_Arrays = list["np.ndarray | None"]

# Quantized element types QuantizeLinear can produce, as numpy dtypes.
_FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
_INTEGER = frozenset(
    np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, ml_dtypes.int4, ml_dtypes.uint4)
)


def _expand_qparam(param: np.ndarray, x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """Broadcast a QuantizeLinear scale / zero point against ``x`` following the ONNX rules."""
    if param.size == 1 and param.ndim <= 1:
        return param.reshape(())
    axis = axis % x.ndim
    if block_size > 0:
        return np.repeat(param, block_size, axis=axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    return param.reshape(shape)


def _quantize_linear(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | None:
    x, scale = inputs[0], inputs[1]
    zero_point = inputs[2] if len(inputs) > 2 else None
    if x is None or scale is None or x.dtype != np.float32 or scale.dtype != np.float32:
        return None
    attrs = attributes_of(node)
    axis, block_size = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    if zero_point is not None:
        out_dtype = zero_point.dtype
    else:
        out_dtype = helper.tensor_dtype_to_np_dtype(int(attrs.get("output_dtype", 0)) or TensorProto.UINT8)
    ratio = x / _expand_qparam(scale, x, axis, block_size)  # float32 / float32, correctly rounded like ORT
    if out_dtype in _FLOAT8:
        if zero_point is not None and np.any(zero_point.astype(np.float32) != 0):
            return None
        if int(attrs.get("saturate", 1)):
            limit = float(ml_dtypes.finfo(out_dtype).max)
            ratio = np.clip(ratio, -limit, limit)
        return ratio.astype(out_dtype)
    if out_dtype not in _INTEGER:
        return None
    info = ml_dtypes.iinfo(out_dtype)
    zp = 0.0 if zero_point is None else _expand_qparam(zero_point.astype(np.float64), x, axis, block_size)
    q = np.rint(ratio).astype(np.float64) + zp
    return np.clip(q, int(info.min), int(info.max)).astype(out_dtype)




def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[onnx.NodeProto, _Arrays], np.ndarray]:
    def evaluate(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray:
        a, b = inputs
        return np.asarray(fn(a, b)).astype(np.result_type(a, b), copy=False)

    return evaluate


def _cast(node: onnx.NodeProto, inputs: _Arrays) -> np.ndarray | None:
    x = inputs[0]
    target = np.dtype(helper.tensor_dtype_to_np_dtype(int(attributes_of(node)["to"])))
    if target in _INTEGER and x.dtype in _INTEGER | {np.dtype(np.int32), np.dtype(np.int64)}:
        info = ml_dtypes.iinfo(target)  # integer -> narrower integer (zero points): exact when in range
        values = x.astype(np.int64)
        in_range = values.min(initial=0) >= info.min and values.max(initial=0) <= info.max
        return values.astype(target) if in_range else None
    if np.issubdtype(target, np.integer) or target in (np.float32, np.float64):
        return x.astype(target)
    return None  # float8 casts have saturate / rounding attributes; leave them to onnxruntime


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


_EVALUATORS: dict[str, Callable[[onnx.NodeProto, _Arrays], np.ndarray | None]] = {
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
}


class _ConstantFolder:
    """Evaluates constant values of one graph on demand (memoised)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        graph_inputs = {i.name for i in graph.input}
        self.values: dict[str, np.ndarray | None] = {
            t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in graph_inputs
        }
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in graph.node for o in n.output}

    def value(self, name: str) -> np.ndarray | None:
        if name == "":
            return None
        if name in self.values:
            return self.values[name]
        node = self.producer.get(name)
        result = None
        if node is not None and node.domain in ("", "ai.onnx"):
            result = self._evaluate(node)
        self.values[name] = result
        return result

    def _evaluate(self, node: onnx.NodeProto) -> np.ndarray | None:
        if node.op_type == "Constant":
            attrs = attributes_of(node)
            if "value" in attrs:
                return numpy_helper.to_array(attrs["value"])
            for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                               ("value_ints", np.int64)):
                if key in attrs:
                    return np.asarray(attrs[key], dtype=dtype)
            return None
        evaluate = _EVALUATORS.get(node.op_type)
        if evaluate is None or len(node.output) != 1:
            return None
        inputs = [self.value(name) if name else None for name in node.input]
        if any(v is None for name, v in zip(node.input, inputs, strict=True) if name):
            return None
        return evaluate(node, inputs)


def _initializer_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer}


def _unique_name(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _root_initializer(folder: _ConstantFolder, name: str, initializers: set[str]) -> str:
    """Follow first inputs upstream to the initializer a folded value was computed from (for naming)."""
    while name not in initializers and name in folder.producer and folder.producer[name].input:
        name = folder.producer[name].input[0]
    return name


def _remove_dead_nodes_and_initializers(graph: onnx.GraphProto) -> None:
    live = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used_initializers = [t for t in graph.initializer if t.name in live]
    del graph.initializer[:]
    graph.initializer.extend(used_initializers)


def _dequantize(node: onnx.NodeProto, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None) -> np.ndarray:
    """DequantizeLinear in numpy: ``(q - z) * s`` with the integer difference exact and the product in float32."""
    attrs = attributes_of(node)
    axis, block_size = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    s = _expand_qparam(scale, q, axis, block_size)
    z = 0.0 if zero_point is None else _expand_qparam(zero_point.astype(np.float64), q, axis, block_size)
    return (q.astype(np.float64) - z).astype(np.float32) * s


def _clamp_chain(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]],
                 folder: _ConstantFolder) -> tuple[list[onnx.NodeProto], np.ndarray | None, np.ndarray | None] | None:
    """The ``Clip(lo, hi)`` or ``Max(lo) -> Min(hi)`` (either order) applied to a DequantizeLinear's output alone."""
    chain: list[onnx.NodeProto] = []
    low = high = None
    current = node.output[0]
    while len(consumers.get(current, [])) == 1 and len(chain) < 2:
        user = consumers[current][0]
        if user.op_type == "Clip" and not chain and user.input[0] == current:
            bounds = [folder.value(n) if n else None for n in list(user.input[1:3]) + [""] * (3 - len(user.input))]
            if any(name and value is None for name, value in zip(user.input[1:3], bounds, strict=False)):
                return None
            return [user], bounds[0], bounds[1]
        if user.op_type not in ("Max", "Min") or len(user.input) != 2:
            break
        other = folder.value(user.input[1] if user.input[0] == current else user.input[0])
        if other is None or (user.op_type == "Max" and low is not None) or (user.op_type == "Min" and high is not None):
            break
        low, high = (other, high) if user.op_type == "Max" else (low, other)
        chain.append(user)
        current = user.output[0]
    return (chain, low, high) if chain else None


def _fold_narrow_range_clamps(graph: onnx.GraphProto, folder: _ConstantFolder) -> int:
    """Move float clamps after a constant DequantizeLinear into its quantized data (narrow ranges).

    The spec translation clamps narrow ranges (int8 ``[-127, 127]``) after DequantizeLinear, in float, which would
    keep onnxruntime from fusing ``DequantizeLinear -> Conv``. For a constant weight the clamp is applied to the
    stored integers instead; the rewrite is kept only if it reproduces the clamped floats exactly.
    """
    initializers = {t.name: t for t in graph.initializer}
    consumers = readers_of(graph)
    removed: list[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in initializers:
            continue
        q = numpy_helper.to_array(initializers[node.input[0]])
        if q.dtype not in _INTEGER:
            continue
        scale = folder.value(node.input[1])
        zero_point = folder.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        found = _clamp_chain(node, consumers, folder)
        if scale is None or found is None or len(consumers[node.input[0]]) != 1:
            continue
        chain, low, high = found
        values = _dequantize(node, q, scale, zero_point)
        clamped = values
        if low is not None:
            clamped = np.maximum(clamped, low.astype(np.float32))
        if high is not None:
            clamped = np.minimum(clamped, high.astype(np.float32))
        attrs = attributes_of(node)
        axis, block_size = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
        s = _expand_qparam(scale, q, axis, block_size).astype(np.float64)
        z = 0.0 if zero_point is None else _expand_qparam(zero_point.astype(np.float64), q, axis, block_size)
        q_new = np.clip(np.rint(clamped.astype(np.float64) / s) + z, *_integer_bounds(q.dtype)).astype(q.dtype)
        if not np.array_equal(_dequantize(node, q_new, scale, zero_point), clamped):
            continue
        initializers[node.input[0]].CopyFrom(numpy_helper.from_array(q_new, node.input[0]))
        node.output[0] = chain[-1].output[0]
        removed.extend(chain)
        folded += 1
    for n in removed:
        graph.node.remove(n)
    return folded


def _drop_zero_zero_points(graph: onnx.GraphProto, folder: _ConstantFolder) -> int:
    """Remove all-zero zero points of constant, blocked integer weights (optional input, default 0: exact).

    Symmetric blocked int4 weights would otherwise store one zero per block, about 2.5 % of the file. Per-tensor
    and per-channel zero points are a few bytes and stay: onnxruntime's QGemm fusion requires them.
    """
    initializers = {t.name for t in graph.initializer}
    dropped = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 3 or node.input[0] not in initializers:
            continue
        if not int(attributes_of(node).get("block_size", 0)):
            continue
        zero_point = folder.value(node.input[2]) if node.input[2] else None
        if zero_point is None or zero_point.dtype not in _INTEGER or np.any(zero_point.astype(np.int64) != 0):
            continue
        del node.input[2]
        dropped += 1
    return dropped


def _integer_bounds(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def fold_quantized_weights(model: onnx.ModelProto) -> int:
    """Fold constant chains feeding ``DequantizeLinear`` nodes into quantized initializers, in place.

    Args:
        model: The exported model (main graph only; functions and subgraphs are not touched).

    Returns:
        The number of changes: ``DequantizeLinear`` data inputs replaced by a quantized initializer, plus
        narrow-range clamps moved into the stored integers (0 means the model is unchanged).
    """
    graph = model.graph
    folder = _ConstantFolder(graph)
    initializers = _initializer_names(graph)
    taken = initializers | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    folded_inputs: dict[str, str] = {}
    data_inputs_folded = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        for index, name in enumerate(node.input):
            if not name or name in initializers:
                continue
            if name not in folded_inputs:
                value = folder.value(name)
                if value is None:
                    continue
                if index == 0:
                    root = _root_initializer(folder, name, initializers)
                    base = f"{root}_quantized" if root in initializers else name
                else:  # named after the (folded) data input it scales: "conv.bias_quantized_scale"
                    base = f"{node.input[0]}_{'scale' if index == 1 else 'zero_point'}"
                new_name = _unique_name(base, taken)
                graph.initializer.append(numpy_helper.from_array(value, new_name))
                folder.values[new_name] = value
                initializers.add(new_name)
                folded_inputs[name] = new_name
                data_inputs_folded += index == 0
            node.input[index] = folded_inputs[name]
    clamps_folded = _fold_narrow_range_clamps(graph, folder)
    zero_points_dropped = _drop_zero_zero_points(graph, folder) if data_inputs_folded else 0
    if folded_inputs or clamps_folded or zero_points_dropped:
        _remove_dead_nodes_and_initializers(graph)
    return data_inputs_folded + clamps_folded
