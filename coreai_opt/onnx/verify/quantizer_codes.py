"""Codes at every activation quantizer, eager vs onnxruntime: statistics that separate rounding from defects.

``verify_onnx`` runs a copy of the file with every activation ``QuantizeLinear`` output added as a graph output
(the quantizer boundaries of :mod:`coreai_opt.onnx.verify.localize`) and records, in eager, every call of
``coreai_opt::quantize_dequantize`` with its scale and zero point. Per quantizer, over ``n`` codes with
``d = q_onnxruntime - q_eager`` (``q_eager = round(y / s) + z`` from eager's own output ``y`` and qparams):

* ``identical = #(d = 0) / n``, ``within_one = #(|d| ≤ 1) / n``, ``mean_signed = Σd / n``, ``max_abs = max |d|``.

A quantizer passes when all four rules hold (:attr:`QuantizerCodes.rule` names the first that failed, or the
kernel class that judged it when all held), after rule ``nan``: eager's own output has no NaN there (a 0 / 0).

1. ``qparams``: the file's scale and zero point equal eager's (float32 scale, relative ``1e-6``). They are
   written from the same buffers, so any difference is a defect, whether or not it moves a code.
2. ``steps``: ``max_abs`` within the derived path bound (:func:`coreai_opt.onnx.verify.tolerance.tensor_bounds`;
   plus :data:`FLOAT_EXTRA_STEPS` behind float kernels; not judged behind an int8-compute ``MatMulNBits``, whose
   bound counts that layer's int8 steps instead), or within what it inherits: the largest ``max_abs`` measured at
   the quantizers it reads, times 1 behind exact ops (a copy), or times the step gain of one integer product
   (:func:`~coreai_opt.onnx.verify.tolerance.product_step_gain`) plus its own rounding step. The path bound counts
   one step per step, but one flipped attention probability moves an average of values by many (timm samvit_base
   blocks.0 attn @ v: 11 steps measured, bound 8, gain 17.4).
3. ``mismatch``: ``1 - identical ≤ base[class] + gain[class] · p_in + 3 / n``, where ``p_in`` is the largest
   ``1 - identical`` of the quantizers this one reads (:data:`MISMATCH_EXACT` / :data:`MISMATCH_INTEGER` /
   :data:`MISMATCH_FLOAT`, :data:`MISMATCH_GAIN`, :data:`MISMATCH_SLACK_CODES`). A quantizer may inherit what
   the quantizers before it got wrong, but may add only what its own kernels can. Behind exact ops or one integer
   product, ``p_in`` is also at least ``f · Σ m_in / n`` (``m_in``: the differing codes of each quantizer read,
   ``n``: this one's codes, ``f``: 1 for exact ops, which copy, select or combine elementwise; the outputs one input
   reaches for a product, :func:`~coreai_opt.onnx.verify.tolerance.product_fan_out`): a *fraction* that grows where
   fewer codes come out than went in (swin_s3's window reverse: 2.27 % -> 4.89 %; efficientnet_b0's SE reduce).
4. ``bias`` (``exact`` / ``integer`` classes): ``|Σd| ≤ BIAS_Z·sqrt(Σd²) + 1 + BIAS_TIES·n`` when every quantizer
   it reads has identical codes (:data:`BIAS_MAX_UPSTREAM` = 0). Float kernels are exempt: behind blocked int4
   weights run in float they shift one way (conv_transpose_decoder w4a8, first conv: 1.25 % of 131072 codes differ,
   Σd = -917, z = 23, clean file). Legitimate differences of a quantizer's own kernels are ±1 flips at rounding ties,
   as likely up as down (``Σd`` has standard deviation ``sqrt(Σd²)``), except where a kernel's tie rule differs from
   eager's (a few codes per 10⁴, one way: ``BIAS_TIES``); a defect shifts many codes the same way. Differences it
   inherits are neither independent nor unbiased: an exact copy (a crop) of a float conv's codes carries that
   conv's one-way shift, and one flipped input of a matrix product moves a whole output row by ``s_x · w[n, k]``.
   Measured on clean files far below 1 % upstream: timm davit_tiny w8a8 attn.proj, 1219 of 338688 codes differ
   behind 0.085 % differing inputs, z = 9.7; a w4a8 crop of a float conv (test_verify_inherited.py) z = 10.
   Defects are then left to rules 1-3 and 5.

5. ``missing``: every activation quantizer eager calls (a ``coreai_opt::quantize_dequantize`` whose input is
   computed from the batch, not from parameters, buffers or constants only) must have a counterpart in the file:
   a node traced from that call, an untraced pair reading its scale buffer, a traced call with the same scale (a
   shared quantizer) or with equal input bytes, scale and zero point (a duplicate the exporter merged, hf-funnel);
   :mod:`coreai_opt.onnx.verify.missing_calls` says why equal *outputs* would not do. A call with none of these
   was dropped from the file; its readers read the float tensor. The quantizers behind it only see an input that
   differs a little (hf-llama: a dropped pair moved the output 4 of 60 allowed steps, 103 quantizers compared,
   none failing), so the quantizer is reported itself, before the quantizers of later calls. Not seen: a dropped
   pair of a quantizer shared with a call still in the file, or of a call whose output another call in the file
   duplicates exactly. Measured: 0 calls missing on the 49 clean zoo x preset files and on clean hf-llama
   (benchmarks/verify/RESULTS.md).

Kernel classes, from the non-exact onnxruntime kernels between this quantizer and the quantizers it reads
(:data:`coreai_opt.onnx.verify.ort_kernels.KERNELS`, onnxruntime's optimized graph of the instrumented copy):

* ``integer-exact``: onnxruntime computes the quantizer's codes in ``QLinearConv`` / ``QGemm`` /
  ``QLinearMatMul`` (:func:`integer_kernel_of`), the eager forward computed the same layer with the kernel's own
  arithmetic (exact accumulation, float32 multiplier, round half to even, saturation:
  :class:`~coreai_opt.onnx.verify.integer_reference.IntegerReference`), and every quantizer it reads has identical
  codes. Its codes must then be identical: 0 steps, 0 differing codes (no slack), and rule 4. Measured on the clean
  w8a8 zoo: 100 % identical at all 105 such quantizers (mobilenet_v2 53, resnet18 21, transformer_encoder 13 with
  its attention ``QLinearMatMul``, torch_transformer 7, conv_transpose_decoder 5, shape_unpack 3, conv1d_groupnorm
  3), where float eager had 0.84 % differing at mobilenet_v2's classifier.
  When a quantizer it reads differs (behind a float kernel or a ``QLinearAdd``), it is judged as ``integer``;
* ``exact``: none (moves, max-pooling, IEEE elementwise ops): codes can differ only where the inputs' do;
* ``integer``: only integer kernels (``QLinearAdd``, ``QLinearGlobalAveragePool``, ..., or ``QLinearConv`` /
  ``QGemm`` / ``QLinearMatMul`` behind differing inputs): requantised with float scale ratios against eager's
  float computation; a code differs only at a rounding tie. Measured with float eager at every integer kernel
  (before ``integer-exact``), clean w8a8 zoo: 0 differing codes on resnet18, conv_transpose_decoder, shape_unpack,
  conv1d_groupnorm; where inputs differ, mobilenet_v2's classifier goes from 0.84 % to 4.4 % (7 of 160 codes),
  torch_transformer's attention from 1.4 % to 2.8 %;
* ``float``: float kernels (``Conv``/``Gemm``/``MatMul`` left in float, e.g. behind blocked int4 weights,
  ``LayerNormalization``, ``Softmax``, ``Gelu``, ...): accumulation order and transcendental approximations.
  Measured: 5.7 % at resnet18 w4a8's first float conv with identical inputs, and growth from 3.5 % to 61 % at its
  classifier;
* ``16-bit``: 16-bit codes (``w8a16``): their step is so fine that float ulps upstream flip many codes (measured up
  to 57 % differing on resnet18, within the derived step bound), so only rules 1 and 2 judge them.

Measured against defects (``tests/onnx/test_verify_mutations.py``, w8a8 zoo; corpus: ``benchmarks/verify/RESULTS.md``):
the first quantizer a defect reaches differs in 3 % (2 % of one weight's codes +3, shape_unpack) to 100 % of its
codes; qparams defects are caught by rule 1 where they were written.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.verify.cache_codes import cache_scales
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.onnx.verify.integer_reference import INTEGER_KERNELS, IntegerReference
from coreai_opt.onnx.verify.localize import Boundary, add_outputs_and_save, non_exact_behind, quantizer_boundaries
from coreai_opt.onnx.verify.missing_calls import input_key, missing_calls, traced_calls, untraced_scales
from coreai_opt.onnx.verify.ort_kernels import kernel_numerics
from coreai_opt.onnx.verify.reading_order import reading_order
from coreai_opt.onnx.verify.tolerance import product_fan_out, product_step_gain, tensor_bounds

__all__ = ["QuantizerCodes", "compare_quantizer_codes", "integer_kernel_of", "MISMATCH_EXACT", "MISMATCH_INTEGER",
           "MISMATCH_FLOAT", "MISMATCH_GAIN", "MISMATCH_SLACK_CODES", "BIAS_Z", "BIAS_TIES", "BIAS_MAX_UPSTREAM",
           "traced_calls"]

#: Allowed fraction of differing codes behind exact ops only.
MISMATCH_EXACT = 0.01
#: Allowed fraction of differing codes behind integer kernels.
MISMATCH_INTEGER = 0.01
#: Allowed fraction of differing codes behind float kernels.
MISMATCH_FLOAT = 0.08
#: Fraction of differing codes a quantizer may inherit per fraction differing at the quantizers it reads, by kernel
#: class: moves pass differences on one for one; a dense integer layer spreads one flipped input over every output
#: (measured 0.84 % -> 4.4 % at mobilenet_v2's classifier, w8a8); a float layer behind blocked int4 weights much more
#: (3.5 % -> 61 % at resnet18's w4a8 classifier).
MISMATCH_GAIN = {"exact": 1.5, "integer": 6.0, "float": 20.0, "16-bit": 0.0, "integer-exact": 0.0}
#: Differing codes always allowed (a few ties decide several % of a 160-code classifier output).
MISMATCH_SLACK_CODES = 3
#: Standard deviations the signed sum of differences may reach (rule 4 of the module docstring).
BIAS_Z = 6.0
#: Fraction of codes a kernel's tie rule may move one way (timm repvit_m1: 1.2 M codes, a few all -1, z > 6).
BIAS_TIES = 1e-4
#: Bias is judged only where inputs differ in at most this fraction (inherited differences correlate: rule 4).
BIAS_MAX_UPSTREAM = 0.0
#: Steps a float-kernel quantizer may exceed its path bound by (conv1d_groupnorm w4a8's GroupNorm -> SiLU: 4 vs 3).
FLOAT_EXTRA_STEPS = 1

_ALLOWED = {"exact": MISMATCH_EXACT, "integer": MISMATCH_INTEGER, "float": MISMATCH_FLOAT, "16-bit": 1.0,
            "integer-exact": 0.0}
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
    node = graph.producer(tensor)
    while node is not None and node.op_type in _LAYOUT_MOVES:
        if node.input[0] in boundaries:
            return None
        node = graph.producer(node.input[0])
    return node.op_type if node is not None and node.op_type in INTEGER_KERNELS else None


@dataclass(frozen=True)
class QuantizerCodes:
    """Eager vs onnxruntime codes at one activation quantizer (module docstring for the rules).

    Attributes:
        call: The traced call, e.g. ``"quantize_dequantize_7"``.
        module: Module path from the exporter's ``namespace`` metadata (``""`` for the top level).
        node: The ``QuantizeLinear`` node and op type.
        count: Codes compared.
        identical: Fraction of identical codes.
        within_one: Fraction within one step.
        mean_signed: Mean of ``q_onnxruntime - q_eager`` in steps.
        max_abs: Largest ``|q_onnxruntime - q_eager|``.
        kernels: ``"exact"``, ``"integer-exact"``, ``"integer"``, ``"float"`` (the kernels onnxruntime runs before
            it) or ``"16-bit"``; it names the rule set that judged the quantizer.
        allowed_steps: The derived path bound on ``max_abs``.
        allowed_mismatch: The kernel class's allowed ``1 - identical``.
        qparams_match: The file's scale and zero point equal eager's.
        rule: The rule that failed (``"nan"``, ``"qparams"``, ``"steps"``, ``"mismatch"``, ``"bias"``, ``"missing"``: no
            node of the file was traced from this call), or ``"<kernels> kernels"`` when it passed.
        ok: Every rule holds.
    """

    call: str
    module: str
    node: str
    count: int
    identical: float
    within_one: float
    mean_signed: float
    max_abs: float
    kernels: str
    allowed_steps: float
    allowed_mismatch: float
    qparams_match: bool
    rule: str
    ok: bool

    @classmethod
    def missing(cls, call: int, shape: tuple[int, ...]) -> QuantizerCodes:
        """An activation quantizer eager calls but no node of the file was traced from (rule 5)."""
        return cls(f"quantize_dequantize_{call}", "", "absent from the file", int(np.prod(shape)), 0.0, 0.0, 0.0,
                   float("inf"), "missing", 0.0, 0.0, False, "missing", False)

    def __str__(self) -> str:
        if self.rule == "missing":
            return (f"{self.call}: eager quantizes an activation of {self.count} values here, but no node of the "
                    f"file (QuantizeLinear, DequantizeLinear or a fused kernel) was traced from this call: the "
                    f"pair was dropped and its readers read the float tensor: FAILS rule missing")
        verdict = "ok" if self.ok else f"FAILS rule {self.rule}"
        return (f"{self.call} ({self.module or '<top>'}, {self.node}): {self.count} codes, "
                f"{100 * self.identical:.2f}% identical, {100 * self.within_one:.2f}% within 1 step, mean "
                f"{self.mean_signed:+.3f}, max {self.max_abs:g} (allowed {self.allowed_steps:g} steps, "
                f"{100 * self.allowed_mismatch:g}% differing, {self.kernels} kernels), "
                f"qparams {'match' if self.qparams_match else 'DIFFER'}: {verdict}")


class _RecordQuantizeCalls(TorchDispatchMode):
    """Counts every ``coreai_opt::quantize_dequantize`` call in call order, keeping only the wanted ones.

    A wanted call (an activation boundary) keeps ``(output, scale, zero_point)`` in :attr:`calls`; a fake-quantized
    weight is never copied. Given ``traced``, every activation call also keeps a key of its input's bytes and its
    qparams in :attr:`keys` (:func:`~coreai_opt.onnx.verify.missing_calls.input_key`), to tell a duplicate the
    exporter merged from a dropped pair.
    Every op's outputs computed from a tensor derived from ``inputs`` (the batch) are derived too; a quantizer call
    whose input is derived is an activation call (:attr:`activations`: index -> (shape, storage address of its scale)).
    Quantizers of tensors computed from constants only (a causal mask or rotary table built from ``arange``) are
    not: the exporter folds them into constants with their producers (clean hf-llama: two such calls, no node left
    in the file).
    """

    def __init__(self, wanted: set[int], inputs: tuple[torch.Tensor, ...], traced: set[int] | None = None) -> None:
        super().__init__()
        self.wanted = wanted
        self.traced = traced
        self.count = 0
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, tuple[object, ...]] = {}
        self.activations: dict[int, tuple[tuple[int, ...], int]] = {}
        self.derived = WeakIdKeyDictionary()
        for tensor in inputs:
            self.derived[tensor] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        derived = any(isinstance(t, torch.Tensor) and t in self.derived
                      for t in pytree.tree_leaves((args, kwargs or {})))
        if derived:
            for t in pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        if func is torch.ops.coreai_opt.quantize_dequantize.default:
            if self.count in self.wanted:
                self.calls[self.count] = (result.detach().clone(), args[1].detach().clone(), args[2].detach().clone())
            if args[0] in self.derived:
                self.activations[self.count] = (tuple(args[0].shape), args[1].untyped_storage().data_ptr())
                if self.traced is not None:
                    self.keys[self.count] = input_key(args[0], args[1], args[2])
            self.count += 1
        return result


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


def _broadcast(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    if values.size == 1:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return values.reshape(shape)


def _feeding(graph: OnnxGraph, tensor: str, boundaries: set[str]) -> tuple[str, set[str], float | None, int | None]:
    """(kernel class, boundaries read, step gain and fan-out: 1 if exact, one integer product's, else None)."""
    nodes, reached = non_exact_behind(graph, tensor, boundaries)
    if not nodes:
        return "exact", reached, 1.0, 1
    kind = "integer" if all((e := kernel_numerics(n)) is not None and e.integer_output for n in nodes) else "float"
    one = nodes[0] if len(nodes) == 1 else None
    return kind, reached, *((product_step_gain(one, graph), product_fan_out(one, graph)) if one else (None, None))


def _judge(b: Boundary, got: np.ndarray, eager: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           kernels: str, allowed_steps: float, upstream_mismatch: float, upstream_differing: float = 0.0
           ) -> QuantizerCodes | None:
    y, scale, zero_point = (t.double().numpy() for t in eager)
    if y.shape != got.shape and y.size == got.size and scale.size == 1:
        y = y.reshape(got.shape)  # a linear on [B, T, D] exported as Reshape -> Gemm quantizes the [B·T, D] view
    float8 = b.zero_point is not None and b.zero_point.dtype.kind not in "iu"  # float8 bits arrive as uint8
    if float8 or got.dtype.kind not in "iu" or y.shape != got.shape or b.scale is None or scale.size != b.scale.size:
        return None  # float8 codes, or not the same tensor (an op the exporter rewrote)
    file_zp = b.zero_point if b.zero_point is not None else np.zeros_like(b.scale)
    qparams_match = bool(np.allclose(b.scale.reshape(-1).astype(np.float64), scale.reshape(-1), rtol=1e-6, atol=0)
                         and np.array_equal(file_zp.reshape(-1).astype(np.int64),
                                            np.broadcast_to(zero_point, scale.shape).reshape(-1).astype(np.int64)))
    s = _broadcast(scale.reshape(-1) if scale.size > 1 else scale, b.axis, y.ndim)
    z = _broadcast(np.broadcast_to(zero_point, scale.shape).reshape(-1) if scale.size > 1 else zero_point, b.axis,
                   y.ndim)
    y = np.where(nan := np.isnan(y), 0.0, y)  # rule nan; the other values are still compared for the report
    d = got.astype(np.int64) - (np.rint(y / s) + z).astype(np.int64)
    n = max(d.size, 1)
    identical, within_one = float((d == 0).sum()) / n, float((np.abs(d) <= 1).sum()) / n
    total, energy = float(d.sum()), float((d * d).sum())
    max_abs = float(np.abs(d).max(initial=0))
    if got.dtype.itemsize > 1:  # 16-bit codes: float ulps upstream flip many of these fine steps (module docstring)
        kernels = "16-bit"
    slack = 0.0 if kernels == "integer-exact" else MISMATCH_SLACK_CODES / n
    inherited = max(upstream_mismatch, min(1.0, upstream_differing / n))  # differing codes x fan-out: 0 if unknown
    allowed_mismatch = _ALLOWED[kernels] + MISMATCH_GAIN[kernels] * inherited + slack
    unbiased = (kernels not in ("exact", "integer", "integer-exact") or upstream_mismatch > BIAS_MAX_UPSTREAM
                or abs(total) <= BIAS_Z * np.sqrt(energy) + 1.0 + BIAS_TIES * n)
    allowed_steps += FLOAT_EXTRA_STEPS if kernels == "float" else 0
    checks = (("nan", not nan.any()), ("qparams", qparams_match), ("steps", max_abs <= allowed_steps),
              ("mismatch", 1.0 - identical <= allowed_mismatch), ("bias", kernels == "16-bit" or unbiased))
    failed = next((name for name, holds in checks if not holds), None)
    return QuantizerCodes(f"quantize_dequantize_{b.call}", b.module, f"{b.node.name} ({b.node.op_type})", d.size,
                          identical, within_one, total / n, max_abs, kernels, allowed_steps, allowed_mismatch,
                          qparams_match, failed or f"{kernels} kernels", failed is None)


def compare_quantizer_codes(model: nn.Module, path: str | Path, batch: tuple[torch.Tensor, ...], *,
                            providers: Sequence[str] = ("CPUExecutionProvider",)) -> tuple[QuantizerCodes, ...]:
    """Statistics and verdict at every activation quantizer of ``path`` on one batch (module docstring).

    Args:
        model: The converted model that was exported.
        path: The ONNX file ``export_onnx`` wrote for it.
        batch: One batch: a tuple of tensors, one per model input.
        providers: onnxruntime execution providers.

    Returns:
        One :class:`QuantizerCodes` per activation quantizer with integer codes, in graph order (empty when the
        file has none, e.g. weight-only presets; float8 quantizers are left to the output comparison), and one
        failing ``missing`` entry per activation quantizer eager calls that no node of the file was traced from
        (rule 5 of the module docstring), placed before the quantizers of later calls.
    """
    import onnxruntime as ort

    exported = onnx.load(str(path))
    boundaries = quantizer_boundaries(exported)
    if not boundaries:
        return ()
    traced, rebuilt, codes = traced_calls(exported), untraced_scales(exported), cache_scales(model, exported.graph)
    with tempfile.TemporaryDirectory(prefix="coreai_opt_codes_") as tmp:
        # the loaded file itself becomes the instrumented copy, released before onnxruntime loads it: one copy of
        # the weights at a time (the file, then the optimized dump, whose weights stay on disk, then the session)
        instrumented = add_outputs_and_save(exported, [b.tensor for b in boundaries], Path(tmp))
        del exported
        optimized = optimized_model(instrumented, "all")
        graph = OnnxGraph(optimized)
        stops = {b.tensor for b in boundaries}
        reference = IntegerReference({b.call for b in boundaries if integer_kernel_of(graph, b.tensor, stops)})
        recorder = _RecordQuantizeCalls({b.call for b in boundaries}, batch, traced)
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
        del session
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
        codes = _judge(b, got, recorder.calls[b.call], kernels, allowed, upstream,
                       sum(differing.get(t, 0.0) for t in feeding) * (fan_out or 0))
        if codes is not None:
            mismatch[b.tensor], differing[b.tensor] = 1.0 - codes.identical, round(codes.count * (1 - codes.identical))
            steps[b.tensor], judged[i] = codes.max_abs, codes
    return _with_missing([judged[i] for i in sorted(judged)], missing)
