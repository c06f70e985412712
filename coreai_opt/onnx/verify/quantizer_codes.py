"""Codes at every activation quantizer, eager vs onnxruntime, judged by :mod:`coreai_opt.onnx.verify.code_rules`.

``verify_onnx`` runs a copy of the file with every activation ``QuantizeLinear`` output added as a graph output
(the quantizer boundaries of :mod:`coreai_opt.onnx.verify.localize`), then the eager model twice on the same batch:
free-running (what eager computes on its own, recorded at every ``coreai_opt::quantize_dequantize`` call with its
scale and zero point: :class:`~coreai_opt.onnx.verify.quantize_calls.RecordQuantizeCalls`), and forced (each
quantizer handing on onnxruntime's codes: :class:`~coreai_opt.onnx.verify.quantize_calls.ForceQuantizeCalls`), both
with onnxruntime's integer-kernel arithmetic where it applies
(:class:`~coreai_opt.onnx.verify.integer_reference.IntegerReference`). Each quantizer's kernel class comes from the
onnxruntime kernels between it and the quantizers it reads, in onnxruntime's optimized graph of the copy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils import _pytree as pytree

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.verify.cache_codes import cache_scales
from coreai_opt.onnx.verify.code_rules import Forced, QuantizerCodes, judge_codes
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.onnx.verify.integer_reference import INTEGER_KERNELS, IntegerReference
from coreai_opt.onnx.verify.localize import Boundary, add_outputs_and_save, non_exact_behind, quantizer_boundaries
from coreai_opt.onnx.verify.merged_pairs import merged_pairs
from coreai_opt.onnx.verify.missing_calls import missing_calls, traced_calls, untraced_scales
from coreai_opt.onnx.verify.ort_kernels import kernel_numerics
from coreai_opt.onnx.verify.quantize_calls import NEAR_TIE, ForceQuantizeCalls, RecordQuantizeCalls
from coreai_opt.onnx.verify.reading_order import reading_order
from coreai_opt.onnx.verify.tolerance import product_fan_out, product_step_gain, tensor_bounds

__all__ = ["QuantizerCodes", "compare_quantizer_codes", "integer_kernel_of", "rounding_width", "traced_calls"]

# Ops onnxruntime inserts between an integer kernel and the quantizer's tensor without touching a value (the
# NHWC layout transformer's Transpose back to NCHW, a linear's Reshape back to [B, T, N]).
_LAYOUT_MOVES = frozenset({"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})


def integer_kernel_of(graph: OnnxGraph, tensor: str, boundaries: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The integer kernel (:data:`~coreai_opt.onnx.verify.integer_reference.INTEGER_KERNELS`) computing ``tensor``.

    Walks back from ``tensor`` through layout moves of one data input to the first op that computes; returns its
    op type when it is one of those kernels, else None. A walk that reaches another of the ``boundaries`` returns
    None: ``tensor`` is a moved copy of that quantizer's codes (a second quantizer with the same grid on a
    reshaped view, which onnxruntime folds away), not the kernel's own output.
    """
    node = _computing_node(graph, tensor, boundaries)
    return node.op_type if node is not None and node.op_type in INTEGER_KERNELS else None


def _computing_node(graph: OnnxGraph, tensor: str, boundaries: frozenset[str] | set[str] = frozenset()
                    ) -> onnx.NodeProto | None:
    """The first op behind ``tensor`` that computes, through layout moves of one data input.

    None at a graph input, or where the walk reaches one of the ``boundaries``.
    """
    node = graph.producer(tensor)
    while node is not None and node.op_type in _LAYOUT_MOVES:
        if node.input[0] in boundaries:
            return None
        node = graph.producer(node.input[0])
    return node


def rounding_width(graph: OnnxGraph, b: Boundary) -> float:
    """Steps from a rounding boundary within which a one-step flip at ``b`` is its kernel's arithmetic.

    :data:`~coreai_opt.onnx.verify.quantize_calls.NEAR_TIE`, or ``e / s`` where the kernel computing the quantized
    value (fused, as ``QLinearSigmoid``, or read by the ``QuantizeLinear``, through layout moves) is accurate to an
    absolute error ``e`` only (:attr:`~coreai_opt.onnx.verify.ort_kernels.KernelNumerics.absolute_error`) and ``s`` is
    the quantizer's finest step.
    """
    node = _computing_node(graph, b.tensor)
    if node is not None and node.op_type == "QuantizeLinear":
        node = _computing_node(graph, node.input[0])
    entry = kernel_numerics(node) if node is not None else None
    if entry is None or not entry.absolute_error or b.scale is None or not np.all(b.scale > 0):
        return NEAR_TIE
    return max(NEAR_TIE, entry.absolute_error / float(np.min(b.scale)))


def _with_missing(results: list[QuantizerCodes], missing: list[QuantizerCodes]) -> tuple[QuantizerCodes, ...]:
    """``missing`` (call order) merged into ``results`` (graph order), each before the first later call."""
    merged: list[QuantizerCodes] = []
    pending = sorted(missing, key=_call_index)
    for codes in results:
        while pending and _call_index(pending[0]) < _call_index(codes):
            merged.append(pending.pop(0))
        merged.append(codes)
    return tuple(merged + pending)


def _call_index(codes: QuantizerCodes) -> int:
    return int(codes.call.rsplit("_", 1)[1])


def _feeding(graph: OnnxGraph, tensor: str, boundaries: set[str]) -> tuple[str, set[str], float | None, int | None]:
    """(kernel class, boundaries read, step gain and fan-out: 1 if exact, one integer product's, else None)."""
    nodes, reached = non_exact_behind(graph, tensor, boundaries)
    if not nodes:
        return "exact", reached, 1.0, 1
    kind = "integer" if all((e := kernel_numerics(n)) is not None and e.integer_output for n in nodes) else "float"
    one = nodes[0] if len(nodes) == 1 else None
    return kind, reached, *((product_step_gain(one, graph), product_fan_out(one, graph)) if one else (None, None))


def compare_quantizer_codes(model: nn.Module, path: str | Path, batch: tuple[torch.Tensor, ...], *,
                            providers: Sequence[str] = ("CPUExecutionProvider",),
                            forced_batches: Sequence[tuple[torch.Tensor, ...]] = ()
                            ) -> tuple[tuple[QuantizerCodes, ...], list[list[np.ndarray]]]:
    """Statistics and verdict at every activation quantizer of ``path`` on one batch (module docstring).

    Args:
        model: The converted model that was exported.
        path: The ONNX file ``export_onnx`` wrote for it.
        batch: One batch: a tuple of tensors, one per model input.
        providers: onnxruntime execution providers.
        forced_batches: Batches to run eager on the file's codes too, returning its outputs (flat, as
            ``verify_onnx`` compares them): what eager computes after the file's last quantizers.

    Returns:
        One :class:`QuantizerCodes` per activation quantizer with integer codes, in graph order (empty when the
        file has none, e.g. weight-only presets; float8 quantizers are left to the output comparison), and one
        failing ``missing`` entry per activation quantizer eager calls that no node of the file was traced from
        (rule 5 of the module docstring), placed before the quantizers of later calls; and the forced outputs of
        each of ``forced_batches`` (empty without quantizers).
    """
    import onnxruntime as ort

    exported = onnx.load(str(path))
    boundaries = quantizer_boundaries(exported)
    if not boundaries:
        return (), []
    traced, rebuilt, codes = traced_calls(exported), untraced_scales(exported), cache_scales(model, exported.graph)
    at_boundary = {b.tensor: b for b in boundaries}
    merged = {f"quantize_dequantize_{b.call}": QuantizerCodes.merged(b.call, b.module, b.node.name, pair)
              for pair in merged_pairs(exported) if (b := at_boundary.get(pair.tensor)) is not None}  # rule 6
    with tempfile.TemporaryDirectory(prefix="coreai_opt_codes_") as tmp:
        # the loaded file itself becomes the instrumented copy, released before onnxruntime loads it: one copy of
        # the weights at a time (the file, then the optimized dump, whose weights stay on disk, then the session)
        instrumented = add_outputs_and_save(exported, [b.tensor for b in boundaries], Path(tmp))
        del exported
        optimized = optimized_model(instrumented, "all")
        graph = OnnxGraph(optimized)
        stops = {b.tensor for b in boundaries}
        reference = IntegerReference({b.call for b in boundaries if integer_kernel_of(graph, b.tensor, stops)})
        recorder = RecordQuantizeCalls({b.call for b in boundaries}, batch, traced)
        with torch.no_grad(), reference, recorder:
            model(*batch)
        buffers = {t.untyped_storage().data_ptr(): name.replace(".", "_") for name, t in model.named_buffers()}
        missing = [QuantizerCodes.missing(call, shape)
                   for call, shape in missing_calls(recorder.activations, recorder.keys, traced, rebuilt, buffers)]
        boundaries = [b for b in boundaries if b.call in recorder.calls]
        tensors = [b.tensor for b in boundaries]
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(instrumented), options, providers=list(providers))
        names = [i.name for i in session.get_inputs()]
        values = session.run(tensors, codes.feed(names, batch))
        widths = {b.call: width for b in boundaries if (width := rounding_width(graph, b)) > NEAR_TIE}
        forced_outputs = [_forced_forward(model, reference.calls, boundaries,
                                          session.run(tensors, codes.feed(names, b)), b, widths)[1]
                          for b in forced_batches]
        del session
    # eager again, each quantizer reading onnxruntime's codes at the ones before: what its own kernels add
    (forced_reference, forcing), _ = _forced_forward(model, reference.calls, boundaries, values, batch, widths)
    bounds, boundary_tensors = tensor_bounds(optimized), set(tensors)
    # per quantizer: differing fraction (rule 3), differing codes, largest difference (rule 2)
    mismatch: dict[str, float] = {}
    differing, steps, judged = dict(mismatch), dict(mismatch), {}
    feeds = [_feeding(graph, b.tensor, boundary_tensors - {b.tensor}) for b in boundaries]
    for i in reading_order(tensors, {b.tensor: feed[1] for b, feed in zip(boundaries, feeds, strict=True)}):
        (b, got), (kernels, feeding, gain, fan_out) = (boundaries[i], values[i]), feeds[i]
        bound = bounds.get(b.tensor)
        # behind an int8-compute MatMulNBits the path bound counts that layer's own int8 steps, not this quantizer's
        derived = bound is not None and bound.int8_layer is None and not bound.int8_codes
        allowed = float(bound.steps) if derived else float("inf")
        if gain is not None and feeding and (measured := max(steps.get(t, 0.0) for t in feeding)) > 0:
            allowed = max(allowed, float(np.ceil(measured * gain - 1e-6)) + (kernels != "exact"))  # rule 2
        upstream = max((mismatch.get(t, 0.0) for t in feeding), default=0.0)
        if b.call in reference.replaced and upstream == 0.0:
            kernels, allowed = "integer-exact", 0.0
        exact_layer = b.call in forced_reference.replaced
        forced = Forced(forcing.calls[b.call], "integer-exact" if exact_layer else feeds[i][0],
                        0.0 if exact_layer else float(bound.steps) if derived else float("inf")
                        ) if b.call in forcing.calls else None
        codes = judge_codes(b, got, recorder.calls[b.call], kernels, allowed, upstream,
                       sum(differing.get(t, 0.0) for t in feeding) * (fan_out or 0), forced)
        if codes is not None:
            mismatch[b.tensor], differing[b.tensor] = 1.0 - codes.identical, round(codes.count * (1 - codes.identical))
            steps[b.tensor], judged[i] = codes.max_abs, codes
    compared = [merged.pop(judged[i].call, judged[i]) for i in sorted(judged)]
    return _with_missing(compared, missing + list(merged.values())), forced_outputs


def _forced_forward(model: nn.Module, integer_calls: set[int], boundaries: Sequence[Boundary],
                    values: Sequence[np.ndarray], batch: tuple[torch.Tensor, ...], widths: dict[int, float]
                    ) -> tuple[tuple[IntegerReference, ForceQuantizeCalls], list[np.ndarray]]:
    """Eager on ``batch`` with every quantizer handing on the file's codes ``values``; its modes and flat outputs."""
    reference = IntegerReference(integer_calls)
    forcing = ForceQuantizeCalls({b.call: v for b, v in zip(boundaries, values, strict=True)}, widths)
    with torch.no_grad(), reference, forcing:
        outputs = model(*batch)
    return (reference, forcing), [t.detach().cpu().numpy() for t in pytree.tree_leaves(outputs)]
