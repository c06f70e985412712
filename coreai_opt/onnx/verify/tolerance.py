"""The tolerance of each graph output, derived from the kernels onnxruntime actually runs.

The walk goes over onnxruntime's optimized graph (``ORT_ENABLE_ALL``, what a default session runs) in order and
gives every tensor a :class:`PathBound`: by how many quantization steps its values may differ between eager and
onnxruntime, and why. With the kernel table of :mod:`coreai_opt.onnx.verify.ort_kernels`:

* an ``exact`` op passes its inputs' bound on unchanged;
* a ``pinned`` / ``emulated`` float op marks its result *inexact* (a few float ulps off eager);
* a quantizer stage (``QuantizeLinear``, ``DynamicQuantizeLinear`` or an integer kernel such as ``QLinearConv``)
  rounds. Its bound is ``k + 1`` steps when its input was inexact, came through a requantising integer kernel or
  already differed (``k`` = the largest bound of its inputs), else ``k``. Model behind it: a difference of a few
  ulps moves a value across the rounding boundary at most once (one step), and an input that differs by ``k``
  steps moves the next quantizer by ``k`` of its own steps (a gain of at most one step per step: true of moves,
  pooling and of the layers we measured, whose flips stay isolated; a layer with a larger gain can exceed it).
* a dynamic activation quantizer (``DynamicQuantizeLinear``, or the one inside a fused ``DynamicQuantizeMatMul``)
  is a stage of one step of its own run-time scale ``s = (max(0, max x) - min(0, min x)) / 255``, always
  (``k + 1``, even behind exact ops): the scale is computed from the whole tensor of the call, so two runs that
  present the same values in tensors of other extents (a one-token KV-cache step vs a full regeneration) round
  them on different grids. A fused ``DynamicQuantizeMatMul`` is such a stage followed by a float-output integer
  product; its step exists only at run time, so an output behind it is ``"underived"`` (below), never float
  precision.
* a per-token dynamic quantizer (``PerToken()``: a ``QuantizeLinear`` blocked along the last axis with run-time
  per-row ``s``, ``z``) is an ordinary quantizer stage (``k``, ``k + 1`` behind inexact ops): each row's scale
  comes from that row alone, so the extent of the call does not move it; the integer product behind it is judged
  as quantized (``"underived"`` behind float layers), never at float precision.

Per output (:class:`OutputTolerance`):

* quantized output (produced by a ``DequantizeLinear``): ``k`` of its own steps (0 when every op from the
  quantizers feeding it is exact);
* float output with no activation quantizer on its path (weight-only models): float precision,
  :data:`FLOAT_PRECISION` of the output range (0 if every op on the path is exact);
* float output computed from activation quantizers through exact or averaging ops: ``k + 1`` steps of the
  coarsest quantizer feeding it;
* float output behind other float ops after activation quantizers (their gain is not derived here): the legacy
  :data:`UNDERIVED_RELATIVE` of the output range, and the reason says so;
* an output behind an int8-compute ``MatMulNBits`` (``matmul_compute="int8"``), rule ``"int8 compute"``, derived
  below; behind such a layer and then float layers of unknown gain (normalizations, softmax, another matrix
  product in float): ``"underived"``, :data:`UNDERIVED_RELATIVE` of the range, and the reason says so.

Int8-compute ``MatMulNBits`` (``accuracy_level=4``) quantizes its input ``A`` per row ``m`` and K block ``b`` to
int8 codes with step ``s_x[m, b] = amax / 127`` and multiplies the codes by the weight. Given the same ``A``,
eager's ``Int8ComputeActivation`` emulation gives the same codes: on the GPT decoder of
``tests/onnx/test_localize.py`` each of the 9 layers' outputs, recomputed in eager from onnxruntime's own ``A``, is
within the float32 accumulation bound :func:`~coreai_opt.quantization.matmul_nbits.int8_compute.accumulation_bound`
(measured at most 9.5e-7, where one flipped code moves an output by a median 5.8e-4 or more): the kernel is
bit-exact up to summation order. What differs is ``A`` itself (float ulps from LayerNorm, GELU, matrix products
upstream), and where that moves a value across a rounding boundary one code flips by one step, moving output ``(m,
n)`` by ``s_x[m, b] · |w[n, k]|``. So the layer is a quantizer stage on its input: its codes may differ by ``c``
steps with ``c = c_in + 1`` (``c_in``: the largest ``c`` of the int8-compute layers before it on the path, through
any op; ``+ 1`` when its input is inexact; the steps of coarser-than-int8 activation quantizers on the way are
added, 16-bit ones are far finer and are not), and an output reached from it through exact, averaging and quantizer
ops differs by at most, per element::

    |Δy[m, n]| ≤ c · u[m, n] + r · s_q + FLOAT_PRECISION · range,    u[m, n] = max_b s_x[m, b] · max_k |w[n, k]|

(``r`` quantizer stages after the layer, ``s_q`` their step; ``u`` is computed by ``verify_onnx`` from the file's
weights and onnxruntime's ``A``, :mod:`coreai_opt.onnx.verify.int8_compute_steps`). ``c`` counts flipped-code units
the way
the quantizer rule counts steps: a flip changes the next layer's input by at most its step times its weights, which
flips at most one more code of the next int8 layer per step (isolated flips). Measured on that decoder (dim 64, 2
blocks, 9 int8-compute layers, 4 batches of 8 × 16 tokens): codes differ in 0 to 0.6 % of ``A`` (at most 2 steps,
once, w4 ``blocks.1.out``), at most 50 of 256 codes in one row; the difference at each layer's output is at most 7.7
``u`` (``c`` = 8 there) and at the logits 3.4 ``u`` (w8) / 3.8 ``u`` (w4) against ``c = 9``: max |diff| 0.0093 /
0.010 / 0.015 (w8 / w4 / w8a16) against a bound of 0.034 / 0.036 / 0.033 at the largest ``u`` (0.7 % of the range,
where the former flat rule allowed 2 %). A weight scale of the LM head off by 5 % in the file gives 0.086 and fails.
On the test zoo with ``w8`` / ``w4`` at ``compute="int8"`` (the 6 models with linears, 12 files) every output
passes; under this rule (5 models; mobilenet_v2's classifier has ``K = 320``, see below) max |diff| is at most 0.28
% of the range against a bound of at most 1.2 %. Deep stacks raise ``c`` by one per layer. Where it does not hold:
wider layers. The test decoder at dim 512 (K = 512 / 2048, 2 batches): codes still differ by at most one step, but
up to 397 of 2048 codes flip in a row and the layer outputs differ by up to 15 ``u`` (``c`` = 3 to 4) / 34 ``u``
(``c`` = 8); the benchmark's 4-block dim-512 decoder (``benchmarks/matmul_nbits/compute_modes.py``) at w8 exceeded the
per-element bound (max |diff| 0.0276, largest allowed 0.0281). The flip count per row grows with ``K``; the rule is
therefore applied only while every int8-compute layer on the path has ``K ≤`` :data:`INT8_COMPUTE_DERIVED_MAX_K`
(256, where it was measured to hold: 7.7 ``u`` against ``c = 8`` at the tightest layer); beyond it the output falls
back to ``"underived"`` (0.02 of range) and the reason says why.

Every :class:`OutputTolerance` names the kernels responsible, including any ``diverges`` kernel on the path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.matmul_nbits_weight import INT8_EMULATED_SUFFIX
from coreai_opt.onnx.verify.ort_kernels import KernelNumerics, Status, is_int8_compute, kernel_numerics

__all__ = ["PathBound", "OutputTolerance", "derive_tolerances", "FLOAT_PRECISION", "UNDERIVED_RELATIVE",
           "INT8_COMPUTE_DERIVED_MAX_K", "product_step_gain", "product_fan_out"]

#: Float outputs without activation quantizers (weight-only models) may differ by this fraction of their range.
FLOAT_PRECISION = 1e-4
#: Float outputs behind float layers whose gain is not derived: fraction of the output range (the old rule).
UNDERIVED_RELATIVE = 0.02
#: Largest int8-compute ``K`` on a path for which the ``"int8 compute"`` rule is derived (module docstring).
INT8_COMPUTE_DERIVED_MAX_K = 256

# Averaging ops: the mean of values that differ by at most d differs by at most d (gain 1).
_AVERAGING = frozenset({"ReduceMean", "GlobalAveragePool", "AveragePool"})
_16_BIT = frozenset({onnx.TensorProto.INT16, onnx.TensorProto.UINT16})
_QUANTIZE_OPS = frozenset({"QuantizeLinear", "DynamicQuantizeLinear"})
# Float-in, float-out kernels that quantize their activation input with a run-time (dynamic) scale.
_DYNAMIC_INPUT_MATMULS = frozenset({"DynamicQuantizeMatMul"})


@dataclass(frozen=True)
class PathBound:
    """What may differ in one tensor.

    Attributes:
        steps: Steps by which a quantized value may differ (for a float tensor: the bound carried from the
            quantizers it was computed from).
        inexact: Computed by a non-exact op since its last quantizer stage.
        quantized: An activation quantizer stage lies on its path.
        kernels: Non-exact kernels on its path, as ``(op type, node name)`` (for the explanation).
        diverging: The ``diverges`` ones among them.
        sources: Steps of the nearest activation quantizers (for float tensors): ``(name, scale)`` pairs.
        gain_known: Every float op since those quantizers is exact or averaging.
        int8_layer: ``None`` when no int8-compute ``MatMulNBits`` lies on its path; the node name of the last one
            when every op since it is exact, averaging or a quantizer stage (its difference is then a multiple of
            that layer's step); ``""`` when float ops of unknown gain followed it.
        int8_steps: Steps by which that layer's int8 input codes may differ (``k + 1`` rule, module docstring).
        rounds_after_int8: Quantizer stages after that layer (each may round its difference once more).
        int8_codes: The largest ``int8_steps`` of the int8-compute layers on its path (through any op).
        fine_sources: Its nearest activation quantizers are all 16-bit (steps far finer than an int8 step).
        int8_k: The largest ``K`` of the int8-compute layers on its path.
    """

    steps: int = 0
    inexact: bool = False
    quantized: bool = False
    kernels: frozenset[tuple[str, str]] = frozenset()
    diverging: frozenset[tuple[str, str]] = frozenset()
    sources: tuple[tuple[str, float], ...] = ()
    gain_known: bool = True
    int8_layer: str | None = None
    int8_steps: int = 0
    rounds_after_int8: int = 0
    int8_codes: int = 0
    fine_sources: bool = False
    int8_k: int = 0


@dataclass(frozen=True)
class OutputTolerance:
    """The derived tolerance of one graph output.

    Attributes:
        name: ONNX output name.
        rule: ``"exact"``, ``"steps"`` (quantized output, ``steps`` of its own step), ``"float"`` (relative to the
            range), ``"quantizer steps"`` (float output, ``steps`` of ``source_step``), ``"underived"`` or
            ``"int8 compute"`` (``steps`` int8 steps of ``int8_layer``, module docstring).
        steps: Allowed steps (``"steps"`` / ``"quantizer steps"`` / ``"int8 compute"`` rules), else None.
        relative: Allowed fraction of the output range (``"float"`` / ``"underived"``), else None.
        source_step: The quantizer step ``steps`` counts (``"quantizer steps"`` rule), else None.
        reason: One line: which kernels make the difference and why.
        bound: The bound of the output tensor.
        int8_layer: ``"int8 compute"`` rule: the int8-compute ``MatMulNBits`` whose step ``steps`` counts.
        rounds: ``"int8 compute"`` rule: quantizer stages after that layer, each allowed one step of its own
            (:attr:`source_step`, or the output's own step for a quantized output).
    """

    name: str
    rule: str
    steps: int | None
    relative: float | None
    source_step: float | None
    reason: str
    bound: PathBound
    int8_layer: str | None = None
    rounds: int = 0


def _merge_int8(bounds: list[PathBound]) -> tuple[str | None, int, int]:
    """``(int8_layer, int8_steps, rounds_after_int8)`` of an op's inputs (see :class:`PathBound`).

    The int8 unit stays derivable only when exactly one input carries it and no other input carries a difference
    of its own (a sum of two carried differences, or of one and a quantizer's, is not one layer's steps).
    """
    carriers = [b for b in bounds if b.int8_layer is not None]
    if not carriers:
        return None, 0, 0
    others = any(b.int8_layer is None and (b.inexact or b.steps > 0 or b.quantized) for b in bounds)
    if len(carriers) > 1 or others or not carriers[0].int8_layer:
        return "", 0, 0
    return carriers[0].int8_layer, carriers[0].int8_steps, carriers[0].rounds_after_int8


def _merge(bounds: list[PathBound]) -> PathBound:
    kernels = frozenset().union(*(b.kernels for b in bounds))
    diverging = frozenset().union(*(b.diverging for b in bounds))
    sources = tuple(dict.fromkeys(s for b in bounds for s in b.sources))
    fine = [b.fine_sources for b in bounds if b.sources]
    return PathBound(max((b.steps for b in bounds), default=0), any(b.inexact for b in bounds),
                     any(b.quantized for b in bounds), kernels, diverging, sources, all(b.gain_known for b in bounds),
                     *_merge_int8(bounds), max((b.int8_codes for b in bounds), default=0), bool(fine) and all(fine),
                     max((b.int8_k for b in bounds), default=0))


def _scale_of(node: onnx.NodeProto, graph: OnnxGraph, index: int) -> float:
    tensor = graph.initializer(node.input[index]) if len(node.input) > index else None
    return float(np.max(np.abs(numpy_helper.to_array(tensor)))) if tensor is not None else float("nan")


def _zero_point_type(node: onnx.NodeProto, graph: OnnxGraph) -> int | None:
    tensor = graph.initializer(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return tensor.data_type if tensor is not None else None


def _named(node: onnx.NodeProto, bound: PathBound, entry: KernelNumerics) -> PathBound:
    """``bound`` with ``node`` added to its kernels (non-exact) and diverging kernels."""
    kernels, diverging = bound.kernels, bound.diverging
    if entry.status is not Status.EXACT:
        kernels = kernels | {(node.op_type, node.name or node.output[0])}
    if entry.status is Status.DIVERGES:
        diverging = diverging | {(node.op_type, node.name or node.output[0])}
    return replace(bound, kernels=kernels, diverging=diverging)


def _int8_compute(node: onnx.NodeProto, merged: PathBound) -> PathBound:
    """An int8-compute ``MatMulNBits``: a quantizer stage on its input (int8 codes), then an integer product."""
    rounds = merged.inexact or merged.steps > 0 or merged.int8_codes > 0
    codes = merged.int8_codes + int(rounds) + (0 if merged.fine_sources else merged.steps)
    k = max(merged.int8_k, next((int(a.i) for a in node.attribute if a.name == "K"), 0))
    layer = (node.name or node.output[0]) if k <= INT8_COMPUTE_DERIVED_MAX_K else ""
    return PathBound(merged.steps, True, True, merged.kernels, merged.diverging, (), False, layer, codes, 0, codes,
                     int8_k=k)


def _through(node: onnx.NodeProto, entry: KernelNumerics | None, inputs: list[PathBound],
             graph: OnnxGraph) -> PathBound:
    """The bound of ``node``'s outputs from its inputs' bounds."""
    if entry is None:  # unknown kernel: treat as inexact and name it (the audit fails on it separately)
        entry = KernelNumerics(node.op_type, node.domain, Status.PINNED, False, 1, "not in the kernel table")
    merged = _named(node, _merge(inputs), entry)
    if is_int8_compute(node):
        return _int8_compute(node, merged)
    if node.op_type in _DYNAMIC_INPUT_MATMULS:  # a dynamic quantizer stage (one step of its own scale), then float
        return PathBound(merged.steps + 1, True, True, merged.kernels, merged.diverging, (), False,
                         int8_codes=merged.int8_codes, int8_k=merged.int8_k)
    if entry.integer_output:  # a quantizer stage: it rounds
        rounds = merged.inexact or merged.steps > 0 or entry.steps > 0
        carried = merged.rounds_after_int8 + int(rounds) if merged.int8_layer else 0
        return PathBound(merged.steps + int(rounds), False, True, merged.kernels, merged.diverging,
                         int8_layer=merged.int8_layer, int8_steps=merged.int8_steps, rounds_after_int8=carried,
                         int8_codes=merged.int8_codes, int8_k=merged.int8_k)
    if node.op_type == "DequantizeLinear":
        if not merged.quantized:  # a constant weight
            return PathBound(0, False, False, merged.kernels, merged.diverging)
        source = (node.output[0], _scale_of(node, graph, 1))
        return replace(merged, inexact=False, sources=(source,), gain_known=True,
                       fine_sources=_zero_point_type(node, graph) in _16_BIT)
    inexact = merged.inexact or entry.status is not Status.EXACT
    gain_one = entry.status is Status.EXACT or node.op_type in _AVERAGING
    int8_layer = merged.int8_layer if gain_one or merged.int8_layer is None else ""
    return replace(merged, inexact=inexact, gain_known=merged.gain_known and gain_one, int8_layer=int8_layer)


# Integer products of two quantized operands (inputs 0 and 3) -> the index of their output scale.
_PRODUCT_KERNELS = {"QLinearMatMul": 6, "QLinearConv": 6, "NhwcQLinearConv": 6, "QGemm": 7}


def product_step_gain(node: onnx.NodeProto, graph: OnnxGraph) -> float | None:
    """Output steps one input step of an integer product can move one of its terms by (None: not such a product).

    ``max over operands of s · max|other| / s_y``, with ``max|other|`` bounded by the other operand's largest scale
    times its code range about its zero point (255 / 128 steps for 8-bit codes): constants only, no weight loaded.
    One flipped attention probability (step 1/256) times a value of the largest magnitude moves an averaged output
    by up to this many steps: timm samvit_base blocks.0 attn @ v, 17.4 (probabilities) and 33 (values).
    """
    if node.op_type not in _PRODUCT_KERNELS or len(node.input) <= _PRODUCT_KERNELS[node.op_type]:
        return None
    y_scale = graph.constant(node.input[_PRODUCT_KERNELS[node.op_type]])
    gains = []
    for operand in (0, 3):
        other = 3 - operand
        scale, other_scale = graph.constant(node.input[operand + 1]), graph.constant(node.input[other + 1])
        zero = graph.constant(node.input[other + 2]) if node.input[other + 2] else np.zeros((), np.uint8)
        if scale is None or other_scale is None or y_scale is None or zero is None or zero.dtype.kind not in "iu":
            return None
        info, zero = np.iinfo(zero.dtype), zero.astype(np.int64)
        codes = float(np.max(np.maximum(np.abs(info.max - zero), np.abs(info.min - zero))))
        gains.append(float(np.max(np.abs(scale)) * np.max(np.abs(other_scale)) * codes / np.min(np.abs(y_scale))))
    return max(gains)


def product_fan_out(node: onnx.NodeProto, graph: OnnxGraph) -> int | None:
    """Outputs one input element of an integer product with a constant weight reaches (None: not such a product).

    ``QLinearConv``: ``(M / group) · kh · kw`` (weight ``(M, C / group, kh, kw)``); ``QGemm``: ``N``; ``QLinearMatMul``
    of a constant ``B``: its last dim (efficientnet_b0's SE ``conv_reduce``: 224 codes, each input reaching 28).
    """
    stored = graph.initializer(node.input[3]) if node.op_type in _PRODUCT_KERNELS and len(node.input) > 3 else None
    shape = tuple(stored.dims) if stored is not None else ()  # dims only: the data may be in an unread external file
    if len(shape) < 2:
        return None
    if node.op_type in ("QLinearConv", "NhwcQLinearConv"):
        return int(shape[0] // int(attributes_of(node).get("group", 1)) * np.prod(shape[2:]))
    return int(shape[0] if attributes_of(node).get("transB", 0) else shape[-1])  # QGemm (K, N) or (N, K); B of MatMul


def tensor_bounds(model: onnx.ModelProto) -> dict[str, PathBound]:
    """The :class:`PathBound` of every tensor of ``model`` (an onnxruntime-optimized graph, topologically sorted)."""
    graph = OnnxGraph(model)
    bounds: dict[str, PathBound] = {}
    empty = PathBound()
    for node in graph.nodes:
        inputs = [bounds.get(name, empty) for name in node.input if name]
        if node.op_type in ("Shape", "Size"):
            inputs = []  # a shape does not carry values
        result = _through(node, kernel_numerics(node), inputs, graph)
        for name in node.output:
            bounds[name] = result
    return bounds


def _describe(nodes: frozenset[tuple[str, str]]) -> str:
    counts = Counter(op for op, _ in nodes)
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _reason(bound: PathBound, detail: str) -> str:
    parts = [detail]
    if bound.kernels:
        parts.append(f"non-exact kernels on the path: {_describe(bound.kernels)}")
    if bound.diverging:
        parts.append(f"WARNING: {_describe(bound.diverging)} computes differently from eager (ort_kernels: diverges)")
    return "; ".join(parts)


def _int8_tolerance(name: str, bound: PathBound) -> OutputTolerance:
    layers = sorted(node for op, node in bound.kernels if op == "MatMulNBits" and node.endswith(INT8_EMULATED_SUFFIX))
    behind = f"behind {len(layers)} int8-compute MatMulNBits (matmul_compute='int8', emulated bit-exactly in eager)"
    if not bound.int8_layer:
        why = (f"an int8-compute layer with K = {bound.int8_k} > {INT8_COMPUTE_DERIVED_MAX_K} on the path (its "
               "input-code flips per row grow with K; the step count is derived up to "
               f"K = {INT8_COMPUTE_DERIVED_MAX_K})" if bound.int8_k > INT8_COMPUTE_DERIVED_MAX_K
               else "then float layers whose gain is not derived")
        return OutputTolerance(name, "underived", None, UNDERIVED_RELATIVE, None, _reason(bound, (
            f"{behind}, {why}: {UNDERIVED_RELATIVE:g} of range")), bound)
    scales = [s for _, s in bound.sources if np.isfinite(s)]
    rounding = f" + {bound.rounds_after_int8} step(s) of the quantizers after it" if bound.rounds_after_int8 else ""
    return OutputTolerance(name, "int8 compute", bound.int8_steps, None, max(scales) if scales else None,
                           _reason(bound, (
                               f"{behind}: {bound.int8_steps} int8 step(s) of {bound.int8_layer} (one step: the "
                               f"row's s_x = amax/127 times the column's largest |weight|){rounding}, "
                               "1 per rounding stage after float differences")), bound,
                           bound.int8_layer, bound.rounds_after_int8)


def _output_tolerance(name: str, bound: PathBound, quantized_output: bool) -> OutputTolerance:
    if bound.int8_layer is not None:
        return _int8_tolerance(name, bound)
    if quantized_output:
        if bound.steps == 0:
            return OutputTolerance(name, "exact", 0, None, None, _reason(
                bound, "0 steps: every op between this output and its quantizers is exact in onnxruntime"),
                bound)
        return OutputTolerance(name, "steps", bound.steps, None, None, _reason(bound, (
            f"{bound.steps} step(s): 1 per quantizer stage after float accumulation or requantisation")), bound)
    if not bound.quantized:
        if not bound.inexact:
            return OutputTolerance(name, "exact", 0, None, None, _reason(
                bound, "0: float output of exact ops only"), bound)
        return OutputTolerance(name, "float", None, FLOAT_PRECISION, None, _reason(bound, (
            f"float output, no activation quantizer on its path: float precision ({FLOAT_PRECISION:g} of range)")),
            bound)
    steps = bound.steps + int(bound.inexact)
    scales = [s for _, s in bound.sources if np.isfinite(s)]
    if bound.gain_known and scales:
        return OutputTolerance(name, "quantizer steps", steps, None, max(scales), _reason(bound, (
            f"float output of exact/averaging ops after quantizers: {steps} step(s) of the coarsest feeding "
            f"quantizer ({max(scales):.3g})")), bound)
    return OutputTolerance(name, "underived", None, UNDERIVED_RELATIVE, None, _reason(bound, (
        f"float output behind float layers after quantizers (their gain is not derived): {UNDERIVED_RELATIVE:g} of "
        "range")), bound)


def derive_tolerances(optimized: onnx.ModelProto, quantized_outputs: set[str]) -> dict[str, OutputTolerance]:
    """Derive the tolerance of every graph output.

    Args:
        optimized: onnxruntime's optimized graph of the file (``optimized_model(path, "all")``).
        quantized_outputs: Names of the outputs produced by a ``DequantizeLinear`` (seen through moves).

    Returns:
        ``{output name: OutputTolerance}``.
    """
    bounds = tensor_bounds(optimized)
    return {
        o.name: _output_tolerance(o.name, bounds.get(o.name, PathBound()), o.name in quantized_outputs)
        for o in optimized.graph.output
    }
