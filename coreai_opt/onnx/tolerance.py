"""The tolerance of each graph output, derived from the kernels onnxruntime actually runs.

The walk goes over onnxruntime's optimized graph (``ORT_ENABLE_ALL``, what a default session runs) in order and
gives every tensor a :class:`PathBound`: by how many quantization steps its values may differ between eager and
onnxruntime, and why. With the kernel table of :mod:`coreai_opt.onnx.ort_kernels`:

* an ``exact`` op passes its inputs' bound on unchanged;
* a ``pinned`` / ``emulated`` float op marks its result *inexact* (a few float ulps off eager);
* a quantizer stage (``QuantizeLinear``, ``DynamicQuantizeLinear`` or an integer kernel such as ``QLinearConv``)
  rounds. Its bound is ``k + 1`` steps when its input was inexact, came through a requantising integer kernel or
  already differed (``k`` = the largest bound of its inputs), else ``k``. Model behind it: a difference of a few
  ulps moves a value across the rounding boundary at most once (one step), and an input that differs by ``k``
  steps moves the next quantizer by ``k`` of its own steps (a gain of at most one step per step: true of moves,
  pooling and of the layers we measured, whose flips stay isolated; a layer with a larger gain can exceed it).

Per output (:class:`OutputTolerance`):

* quantized output (produced by a ``DequantizeLinear``): ``k`` of its own steps (0 when every op from the
  quantizers feeding it is exact);
* float output with no activation quantizer on its path (weight-only models): float precision,
  :data:`FLOAT_PRECISION` of the output range (0 if every op on the path is exact);
* float output computed from activation quantizers through exact or averaging ops: ``k + 1`` steps of the
  coarsest quantizer feeding it;
* float output behind other float ops after activation quantizers (their gain is not derived here): the legacy
  :data:`UNDERIVED_RELATIVE` of the output range, and the reason says so;
* any output behind an int8-compute ``MatMulNBits`` (``matmul_compute="int8"``; the eager model emulates its
  activation quantization): rule ``"int8 compute"``, :data:`INT8_COMPUTE_RELATIVE` of the output range. The kernel
  re-quantizes its input per row and K block at run time (step ``amax / 127``), so a float-ulp difference upstream
  (LayerNorm, GELU, accumulation order) can move one activation by a whole int8 step there; how far such a flip
  travels is not derived.

Every :class:`OutputTolerance` names the kernels responsible, including any ``diverges`` kernel on the path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from coreai_opt.onnx.matmul_nbits_weight import INT8_EMULATED_SUFFIX
from coreai_opt.onnx.ort_kernels import KernelNumerics, Status, kernel_numerics
from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["PathBound", "OutputTolerance", "derive_tolerances", "FLOAT_PRECISION", "UNDERIVED_RELATIVE",
           "INT8_COMPUTE_RELATIVE"]

#: Float outputs without activation quantizers (weight-only models) may differ by this fraction of their range.
FLOAT_PRECISION = 1e-4
#: Float outputs behind float layers whose gain is not derived: fraction of the output range (the old rule).
UNDERIVED_RELATIVE = 0.02
#: Outputs behind an int8-compute MatMulNBits (dynamic int8 activation steps): fraction of the output range.
INT8_COMPUTE_RELATIVE = 0.02

# Averaging ops: the mean of values that differ by at most d differs by at most d (gain 1).
_AVERAGING = frozenset({"ReduceMean", "GlobalAveragePool", "AveragePool"})
_QUANTIZE_OPS = frozenset({"QuantizeLinear", "DynamicQuantizeLinear"})


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
    """

    steps: int = 0
    inexact: bool = False
    quantized: bool = False
    kernels: frozenset[tuple[str, str]] = frozenset()
    diverging: frozenset[tuple[str, str]] = frozenset()
    sources: tuple[tuple[str, float], ...] = ()
    gain_known: bool = True


@dataclass(frozen=True)
class OutputTolerance:
    """The derived tolerance of one graph output.

    Attributes:
        name: ONNX output name.
        rule: ``"exact"``, ``"steps"`` (quantized output, ``steps`` of its own step), ``"float"`` (relative to the
            range), ``"quantizer steps"`` (float output, ``steps`` of ``source_step``), ``"underived"`` or
            ``"int8 compute"``.
        steps: Allowed steps (``"steps"`` / ``"quantizer steps"`` rules), else None.
        relative: Allowed fraction of the output range (``"float"`` / ``"underived"`` / ``"int8 compute"``), else None.
        source_step: The quantizer step ``steps`` counts (``"quantizer steps"`` rule), else None.
        reason: One line: which kernels make the difference and why.
        bound: The bound of the output tensor.
    """

    name: str
    rule: str
    steps: int | None
    relative: float | None
    source_step: float | None
    reason: str
    bound: PathBound


def _merge(bounds: list[PathBound]) -> PathBound:
    kernels = frozenset().union(*(b.kernels for b in bounds))
    diverging = frozenset().union(*(b.diverging for b in bounds))
    sources = tuple(dict.fromkeys(s for b in bounds for s in b.sources))
    return PathBound(max((b.steps for b in bounds), default=0), any(b.inexact for b in bounds),
                     any(b.quantized for b in bounds), kernels, diverging, sources, all(b.gain_known for b in bounds))


def _scale_of(node: onnx.NodeProto, graph: OnnxGraph, index: int) -> float:
    tensor = graph.initializer(node.input[index]) if len(node.input) > index else None
    return float(np.max(np.abs(numpy_helper.to_array(tensor)))) if tensor is not None else float("nan")


def _step(node: onnx.NodeProto, merged: PathBound, entry: KernelNumerics) -> PathBound:
    kernels, diverging = merged.kernels, merged.diverging
    if entry.status is not Status.EXACT:
        kernels = kernels | {(node.op_type, node.name or node.output[0])}
    if entry.status is Status.DIVERGES:
        diverging = diverging | {(node.op_type, node.name or node.output[0])}
    return PathBound(merged.steps, merged.inexact, merged.quantized, kernels, diverging, merged.sources,
                     merged.gain_known)


def _through(node: onnx.NodeProto, entry: KernelNumerics | None, inputs: list[PathBound],
             graph: OnnxGraph) -> PathBound:
    """The bound of ``node``'s outputs from its inputs' bounds."""
    merged = _merge(inputs)
    if entry is None:  # unknown kernel: treat as inexact and name it (the audit fails on it separately)
        entry = KernelNumerics(node.op_type, node.domain, Status.PINNED, False, 1, "not in the kernel table")
    bound = _step(node, merged, entry)
    if entry.integer_output:  # a quantizer stage: it rounds
        rounds = merged.inexact or merged.steps > 0 or entry.steps > 0
        return PathBound(merged.steps + int(rounds), False, True, bound.kernels, bound.diverging)
    if node.op_type == "DequantizeLinear":
        if not merged.quantized:  # a constant weight
            return PathBound(0, False, False, bound.kernels, bound.diverging)
        source = (node.output[0], _scale_of(node, graph, 1))
        return PathBound(merged.steps, False, True, bound.kernels, bound.diverging, (source,), True)
    inexact = merged.inexact or entry.status is not Status.EXACT
    gain_known = merged.gain_known and (entry.status is Status.EXACT or node.op_type in _AVERAGING)
    return PathBound(merged.steps, inexact, merged.quantized, bound.kernels, bound.diverging, merged.sources,
                     gain_known)


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


def _output_tolerance(name: str, bound: PathBound, quantized_output: bool) -> OutputTolerance:
    int8_compute = sorted(node for op, node in bound.kernels
                          if op == "MatMulNBits" and node.endswith(INT8_EMULATED_SUFFIX))
    if int8_compute:
        return OutputTolerance(name, "int8 compute", None, INT8_COMPUTE_RELATIVE, None, _reason(bound, (
            f"behind {len(int8_compute)} int8-compute MatMulNBits (matmul_compute='int8', emulated in eager): each "
            "re-quantizes its input at run time, where a float-ulp difference upstream can flip one int8 step; "
            f"{INT8_COMPUTE_RELATIVE:g} of range (not derived)")), bound)
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
