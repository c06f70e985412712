r"""Rule: saturate in float before every int16 / uint16 activation ``QuantizeLinear`` (OpenVINO defect 3).

OpenVINO 2026.4's low-precision transformations strip 16-bit ``QuantizeLinear -> DequantizeLinear`` pairs and pass
the float value through unchanged: no rounding and, worse, no saturation. Our exports rely on the saturation (a
ReLU folded into a zero-point-0 quantizer; values past the calibrated range clip), so OpenVINO's outputs were
1e5 steps off on a minimal graph (docs/openvino.md, defect 3). This rule writes the saturation out::

    x -> QuantizeLinear(s, zp)   ==>   x -> Clip(lo, hi) -> QuantizeLinear(s, zp)
    lo = float32((qmin - zp) * s),  hi = float32((qmax - zp) * s)

with ``(qmin, qmax)`` = ``(0, 65535)`` for uint16 and ``(-32768, 32767)`` for int16. A per-axis or blocked
quantizer (a 16-bit activation spec with ``PerChannel`` / ``PerBlock`` and calibrated qparams) gets the same
bounds element by element as ``Max(x, lo) -> Min(., hi)`` (``Clip`` takes scalar bounds only), shaped to broadcast
against ``x`` (rank, and for blocks the blocked dimension, from the recorded shape; unknown: a near miss).

**The clip changes no quantized value:** ``Q(Clip(x)) = Q(x)`` for every float ``x`` (NaN excepted), where
:math:`Q(x) = \mathrm{sat}(\mathrm{round\_half\_even}(x / s) + zp)` with float32 division. Let :math:`k = q - zp`
for a bound ``q`` in ``{qmin, qmax}``; :math:`|k| \le 65535 < 2^{16}`, and :math:`k s` is exact in float64. Its
float32 rounding is :math:`b = k s (1 + \delta)`, :math:`|\delta| \le 2^{-24}` (for a normal result), and the
division gives :math:`\mathrm{fl}(b / s) = k (1 + \delta)(1 + \epsilon)`, :math:`|\epsilon| \le 2^{-24}`, so

.. math:: |\mathrm{fl}(b / s) - k| \le |k| (2^{-23} + 2^{-48}) < 2^{16} \cdot 2^{-22} = 2^{-6} < \tfrac12

hence ``round(b / s) = k`` and ``Q(b) = q`` exactly (a kernel that multiplies by ``fl(1 / s)`` adds one more
:math:`2^{-24}` and stays below :math:`2^{-6}`). For ``s > 0`` the correctly rounded division and the rounding are
monotone, so every ``x < lo`` has ``Q(x) <= Q(lo) = qmin``, i.e. ``Q(x) = qmin = Q(lo) = Q(Clip(x))``; likewise
above ``hi``; between the bounds ``Clip`` is the identity. The rule still evaluates ``Q(lo)`` and ``Q(hi)`` for
every quantizer (a subnormal ``k s``, a non-float32 scale) and records a near miss instead of writing a bound that
fails the check. onnxruntime's output is therefore bit-identical; OpenVINO is left with the rounding it skips
(at most half a step).

Not rewritten: quantizers of constants (weights are stored integers by then), dynamic quantizers (scale computed in
the graph: a near miss), and a quantizer whose input is already bounded within ``[lo, hi]`` by the ops producing
it (``Clip`` / ``Relu`` / ``Max`` / ``Min`` with constant bounds, compared exactly), which makes the rule
idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["ClipSixteenBitActivations", "saturation_bounds"]

_SIXTEEN_BIT = {TensorProto.INT16: np.int16, TensorProto.UINT16: np.uint16}
_BOUNDING_OPS = frozenset({"Clip", "Relu", "Max", "Min"})
_MAX_BOUND_DEPTH = 4


@dataclass(frozen=True, eq=False)
class _Site(Match):
    low: np.ndarray
    high: np.ndarray


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: type) -> np.ndarray:
    """``saturate(round_half_even(x / s) + zp)``, dividing in float32 (float16 too, as onnxruntime does) or wider."""
    info = np.iinfo(dtype)
    wide = np.promote_types(x.dtype, np.float32)
    with np.errstate(all="ignore"):
        steps = np.rint(x.astype(wide) / scale.astype(wide)).astype(np.float64)
    return np.clip(steps + zero_point.astype(np.float64), info.min, info.max)


def saturation_bounds(scale: np.ndarray, zero_point: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """``((qmin - zp) * s, (qmax - zp) * s)``, each product exact in float64, rounded once to the scale's dtype.

    Args:
        scale: The quantizer's scale (any shape).
        zero_point: Its zero point, broadcastable to ``scale``.
        dtype: ``np.int16`` or ``np.uint16``.
    """
    info = np.iinfo(dtype)
    s, z = scale.astype(np.float64), zero_point.astype(np.float64)
    return ((info.min - z) * s).astype(scale.dtype), ((info.max - z) * s).astype(scale.dtype)


def _bounds_of(name: str, graph: OnnxGraph, depth: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An interval ``[low, high]`` (arrays, broadcastable) that the ops producing ``name`` guarantee."""
    unbounded = (np.array(-np.inf), np.array(np.inf))
    node = graph.producer(name)
    if node is None or node.op_type not in _BOUNDING_OPS or node.domain not in ("", "ai.onnx"):
        return unbounded
    if depth > _MAX_BOUND_DEPTH:
        return unbounded
    if node.op_type == "Relu":
        low, high = _bounds_of(node.input[0], graph, depth + 1)
        return np.maximum(low, 0.0), high
    if node.op_type == "Clip":
        low, high = _bounds_of(node.input[0], graph, depth + 1)
        for index, combine in ((1, np.maximum), (2, np.minimum)):
            bound = graph.constant(node.input[index]) if len(node.input) > index and node.input[index] else None
            if bound is not None:
                low, high = (combine(low, bound), high) if index == 1 else (low, combine(high, bound))
        return low, high
    if len(node.input) != 2:
        return unbounded
    constants = [graph.constant(n) for n in node.input]
    if (constants[0] is None) == (constants[1] is None):
        return unbounded
    bound = constants[0] if constants[0] is not None else constants[1]
    low, high = _bounds_of(node.input[1] if constants[0] is not None else node.input[0], graph, depth + 1)
    return (np.maximum(low, bound), high) if node.op_type == "Max" else (low, np.minimum(high, bound))


def _within(inner: tuple[np.ndarray, np.ndarray], low: np.ndarray, high: np.ndarray) -> bool:
    try:
        return bool(np.all(inner[0] >= low) and np.all(inner[1] <= high))
    except ValueError:  # shapes that do not broadcast: not known to be inside
        return False


def _broadcastable(view: QdqView, graph: OnnxGraph, values: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...] | str:
    """Per-axis / blocked bounds reshaped to broadcast against the quantized value, or why they cannot be."""
    shape = graph.shape(view.data)
    if not shape:
        return "per-axis / blocked 16-bit quantizer of a value of unknown rank: no bounds to broadcast"
    axis = view.axis % len(shape)
    if view.block_size == 0:
        dims = [1] * len(shape)
        dims[axis] = -1
        return tuple(v.reshape(dims) for v in values)
    if not isinstance(shape[axis], int):
        return "blocked 16-bit quantizer over a dimension of unknown size: no bounds to broadcast"
    rows = np.arange(shape[axis]) // view.block_size
    return tuple(np.take(v, rows, axis=axis) for v in values)


class ClipSixteenBitActivations(Rule):
    """Put ``Clip((qmin - zp)·s, (qmax - zp)·s)`` before every 16-bit activation quantizer (module docstring)."""

    name = "clip_16bit_activations"
    anchors = frozenset({"QuantizeLinear"})
    #: It only adds nodes: nothing becomes unused, and the rest of the file keeps its bytes.

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | Fail | None:
        """An int16 / uint16 ``QuantizeLinear`` of a computed value that is not yet bounded within its range."""
        view = QdqView.of(node, graph)
        if view is None or view.is_dequantize or view.quant_type not in _SIXTEEN_BIT or view.data_is_constant:
            return None
        if not view.has_constant_qparams:
            return Fail("16-bit quantizer with a scale or zero point computed in the graph: no constant clip bounds")
        scale = view.scale
        zero_point = view.zero_point if view.zero_point is not None else np.zeros((), np.int64)
        if not np.all(scale > 0):
            return Fail("16-bit quantizer with a scale that is not positive: the saturation is not a clip")
        dtype = _SIXTEEN_BIT[view.quant_type]
        low, high = saturation_bounds(scale, zero_point, dtype)
        info = np.iinfo(dtype)
        if not (np.all(quantize(low, scale, zero_point, dtype) == info.min)
                and np.all(quantize(high, scale, zero_point, dtype) == info.max)):
            return Fail(f"the clip bounds of this {scale.dtype} scale do not quantize exactly to the 16-bit range")
        if view.granularity != "per_tensor":
            shaped = _broadcastable(view, graph, (low, high))
            if isinstance(shaped, str):
                return Fail(shaped)
            low, high = shaped
        else:
            low, high = low.reshape(()), high.reshape(())
        if _within(_bounds_of(view.data, graph), low, high):
            return None  # already saturated in float (e.g. by this rule)
        return _Site(node, low, high)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """``x -> Clip(lo, hi) -> Q`` (per-tensor) or ``x -> Max(lo) -> Min(hi) -> Q`` (per-axis, blocked)."""
        assert isinstance(match, _Site)
        node, x = match.node, match.node.input[0]
        low = graph.shared_constant("sixteen_bit_clip_low", match.low)
        high = graph.shared_constant("sixteen_bit_clip_high", match.high)
        clipped = graph.unique_name(f"{x}_saturated")
        name = graph.unique_node_name(f"{node.name or clipped}_saturate")
        if match.low.ndim == 0:
            nodes = [helper.make_node("Clip", [x, low, high], [clipped], name=name)]
        else:
            lowered = graph.unique_name(f"{x}_saturated_below")
            nodes = [helper.make_node("Max", [x, low], [lowered], name=graph.unique_node_name(f"{name}_max")),
                     helper.make_node("Min", [lowered, high], [clipped], name=graph.unique_node_name(f"{name}_min"))]
        graph.insert_before(node, nodes)
        graph.set_input(node, 0, clipped)
