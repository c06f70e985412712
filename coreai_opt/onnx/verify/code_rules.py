"""The rules that judge eager's codes against onnxruntime's at one activation quantizer.

``verify_onnx`` runs a copy of the file with every activation ``QuantizeLinear`` output added as a graph output
(the quantizer boundaries of :mod:`coreai_opt.onnx.verify.localize`) and records, in eager, every call of
``coreai_opt::quantize_dequantize`` with its scale and zero point. Per quantizer, over ``n`` codes with
``d = q_onnxruntime - q_eager`` (``q_eager = round(y / s) + z`` from eager's own output ``y`` and qparams):

* ``identical = #(d = 0) / n``, ``within_one = #(|d| ≤ 1) / n``, ``mean_signed = Σd / n``, ``max_abs = max |d|``.

A quantizer passes when rules 1-4 hold (:attr:`QuantizerCodes.rule` names the first that failed, or the
kernel class that judged it when all held), after rule ``nan``: eager's own output has no NaN there (a 0 / 0).

1. ``qparams``: the file's scale and zero point equal eager's (float32 scale, relative ``1e-6``). They are
   written from the same buffers, so any difference is a defect, whether or not it moves a code.
2. ``steps``: on the file's inputs (the forced run of rule 3), the largest difference is within the derived path
   bound of the quantizer's own kernels (:func:`coreai_opt.onnx.verify.tolerance.tensor_bounds`; 0 for
   ``integer-exact``; plus :data:`FLOAT_EXTRA_STEPS` behind float kernels; not judged behind an int8-compute
   ``MatMulNBits``, whose bound counts that layer's int8 steps instead). Free-running, differences inherited from
   upstream grow through every product (timm mnasnet_small's SE gate: 78 steps free-running, 0 on the file's
   inputs); where the forced run cannot be made, ``max_abs`` is judged against the path bound or what it inherits:
   the largest ``max_abs`` at the quantizers it reads, times 1 behind exact ops or the step gain of one integer
   product (:func:`~coreai_opt.onnx.verify.tolerance.product_step_gain`) plus its own rounding step.
3. ``mismatch``, judged on what the quantizer's own kernels add: eager runs the batch a second time with every
   quantizer before this one handing on onnxruntime's codes
   (:class:`~coreai_opt.onnx.verify.quantize_calls.ForceQuantizeCalls`), so both sides read the same inputs, and ``1
   - own_identical ≤ base[class] + 3 / n`` (:data:`MISMATCH_EXACT`, :data:`MISMATCH_INTEGER`,
   :data:`MISMATCH_FLOAT_OWN`, :data:`MISMATCH_SLACK_CODES`; ``integer-exact``: 0, no slack). A rounding flip early
   in a deep stack spreads over more codes at every integer product after it (timm regnetx_002: 5.9 % of a late
   conv's codes differ free-running, 0 on the file's inputs): a gain on the free-running fraction either passed +3
   weight-code defects or flagged a dozen clean timm / hf models. On the file's inputs the measured clean differences
   are 0 at integer and exact kernels on the zoo and ≤ 0.024 % on hf bert / llama, timm convnext (w8a8); float
   kernels ≤ 0.005 % (w8a8) and ≤ 2.41 % (w4a8, blocked int4 weights). Where that run cannot be made (the codes do
   not fit eager's tensor), the free-running fraction is judged: ``1 - identical ≤ base[class] + gain[class] · p_in +
   3 / n``, ``p_in`` the largest differing fraction of the quantizers it reads (:data:`MISMATCH_FLOAT`,
   :data:`MISMATCH_GAIN`), at least ``f · Σ m_in / n`` behind exact ops or one integer product (``m_in``: their
   differing codes; ``f``: 1 for exact ops, the outputs one input reaches for a product,
   :func:`~coreai_opt.onnx.verify.tolerance.product_fan_out`).
4. ``bias`` (``exact`` / ``integer`` classes), on the same forced differences:
   ``|Σd| ≤ BIAS_Z·sqrt(Σd²) + 1 + BIAS_TIES·n``. Float kernels are exempt: behind blocked int4 weights run in
   float they shift one way (conv_transpose_decoder w4a8, first conv: 1.25 % of 131072 codes differ, Σd = -917,
   z = 23, clean file). Legitimate differences of a quantizer's own kernels are ±1 flips at rounding ties, as
   likely up as down (``Σd`` has standard deviation ``sqrt(Σd²)``), except where a kernel's tie rule differs from
   eager's (a few codes per 10⁴, one way: ``BIAS_TIES``); a defect shifts many codes the same way. Free-running
   (no forced run), differences a quantizer inherits are neither independent nor unbiased (one flipped input of a
   matrix product moves a whole output row by ``s_x · w[n, k]``), so bias is judged there only when every
   quantizer it reads has identical codes (:data:`BIAS_MAX_UPSTREAM` = 0).

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

6. ``merged``: the file quantizes no tensor twice in a row in a way onnxruntime changes. Its
   ``DoubleQDQPairsRemover`` rounds ``Q_A → DQ_A → Q_B → DQ_B`` once, at the intersection of the two ranges; the
   code comparison cannot see it (its instrumented copy reads every quantizer's output, which keeps the pairs
   apart), so :func:`~coreai_opt.onnx.verify.merged_pairs.merged_pairs` finds such pairs in the file itself and
   the second quantizer fails unless the merge is the identity (same grid twice, or a repeat of a quantizer on its
   own grid whose merged parameters are the second's). Measured before ``convert`` and ``annotate`` stopped
   writing them: MobileViTV2 9 pairs (2 at a third scale), timm DenseNet-121 62 (42), a split → ReLU test net
   466 of 800 outputs differing between onnxruntime and eager.

Kernel classes, from the non-exact onnxruntime kernels between this quantizer and the quantizers it reads
(:data:`coreai_opt.onnx.verify.ort_kernels.KERNELS`, onnxruntime's optimized graph of the instrumented copy):

* ``integer-exact``: onnxruntime computes the quantizer's codes in ``QLinearConv`` / ``QGemm`` /
  ``QLinearMatMul`` (:func:`~coreai_opt.onnx.verify.quantizer_codes.integer_kernel_of`), and eager computed the
  same layer from the same input codes (the forced run; free-running, only where every quantizer it reads has
  identical codes) with the kernel's own
  arithmetic (exact accumulation, float32 multiplier, round half to even, saturation:
  :class:`~coreai_opt.onnx.verify.integer_reference.IntegerReference`). Its codes must then be identical: 0
  differing codes (no slack), and rule 4. Measured on the clean w8a8 zoo: 100 % identical at all 105 such
  quantizers (mobilenet_v2 53, resnet18 21, transformer_encoder 13 with its attention ``QLinearMatMul``, ...),
  where float eager had 0.84 % differing at mobilenet_v2's classifier. Otherwise such a layer is ``integer``;
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

from dataclasses import dataclass

import numpy as np
import torch

from coreai_opt.onnx.verify.localize import Boundary
from coreai_opt.onnx.verify.merged_pairs import MergedPair

__all__ = ["Forced", "QuantizerCodes", "judge_codes", "MISMATCH_EXACT", "MISMATCH_INTEGER", "MISMATCH_FLOAT",
           "MISMATCH_FLOAT_OWN", "MISMATCH_GAIN", "MISMATCH_SLACK_CODES", "BIAS_Z", "BIAS_TIES", "BIAS_MAX_UPSTREAM",
           "FLOAT_EXTRA_STEPS"]

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
#: Allowed fraction of differing codes behind float kernels when eager reads the file's codes upstream (rules 3 and
#: 4 on the forced run): clean w8a8 files 0.005 % at most (timm convnext, hf bert / llama), clean w4a8 (a float conv
#: behind blocked int4 weights) 2.41 % at most (zoo mobilenet_v2); a +3 weight-code defect or a rolled per-channel
#: scale on a float ConvTranspose (zoo conv_transpose_decoder w8a8): 5.15 % / 6.16 %.
MISMATCH_FLOAT_OWN = 0.03
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
        rule: The rule that failed (``"nan"``, ``"qparams"``, ``"steps"``, ``"mismatch"``, ``"bias"``, ``"merged"``:
            onnxruntime merges its pair with the one before it, ``"missing"``: no node of the file was traced from
            this call), or ``"<kernels> kernels"`` when it passed.
        ok: Every rule holds.
        own_identical: Fraction of identical codes when eager reads onnxruntime's codes at the quantizers before
            (:class:`~coreai_opt.onnx.verify.quantize_calls.ForceQuantizeCalls`): what rules 3 and 4 judge. None
            where that run could not be made (the free-running statistics are judged then).
        own_max_abs: Largest difference in that run: what rule 2 judges (``allowed_steps`` is then its bound).
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
    own_identical: float | None = None
    own_max_abs: float | None = None

    @classmethod
    def merged(cls, call: int, module: str, node: str, pair: MergedPair) -> QuantizerCodes:
        """A quantizer whose Q/DQ pair onnxruntime merges with the one before it into another rounding (rule 6)."""
        where = (f"{node}: merged into scale {pair.scale:.8g} / zero point {pair.zero_point} where the file says "
                 f"{pair.file_scale:.8g} / {pair.file_zero_point}")
        return cls(f"quantize_dequantize_{call}", module, where, 0, 0.0, 0.0, 0.0, float("inf"), "merged", 0.0, 0.0,
                   False, "merged", False)

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
        if self.rule == "merged":
            return (f"{self.call} ({self.module or '<top>'}, {self.node}): the tensor is quantized twice in a row "
                    f"(Q -> DQ -> Q -> DQ) and onnxruntime's DoubleQDQPairsRemover rounds it once, at other "
                    f"parameters than the file's and eager's: FAILS rule merged")
        verdict = "ok" if self.ok else f"FAILS rule {self.rule}"
        own = "" if self.own_identical is None else \
            f"; on the file's inputs {100 * self.own_identical:.2f}% identical, max {self.own_max_abs:g}"
        return (f"{self.call} ({self.module or '<top>'}, {self.node}): {self.count} codes, "
                f"{100 * self.identical:.2f}% identical, {100 * self.within_one:.2f}% within 1 step, mean "
                f"{self.mean_signed:+.3f}, max {self.max_abs:g}{own} (allowed {self.allowed_steps:g} steps, "
                f"{100 * self.allowed_mismatch:g}% differing, {self.kernels} kernels), "
                f"qparams {'match' if self.qparams_match else 'DIFFER'}: {verdict}")


def _broadcast(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    if values.size == 1:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return values.reshape(shape)


def _differences(b: Boundary, got: np.ndarray, eager: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                 ) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """``(d = q_onnxruntime - q_eager, eager's NaN mask, qparams match)``; None when the tensors do not compare.

    ``eager``: ``(y or its codes, scale, zero_point)``: the fake-quantized output ``y`` (float), or the codes
    :func:`~coreai_opt.onnx.verify.quantize_calls.eager_codes` kept of it (integer; NaN as the dtype's minimum).
    """
    values, scale, zero_point = eager[0], eager[1].double().numpy(), eager[2].double().numpy()
    kept_codes = not values.is_floating_point()
    y = values.numpy() if kept_codes else values.double().numpy()
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
    if kept_codes:
        nan = y == np.iinfo(y.dtype).min
        q = np.where(nan, z, y).astype(np.int64)
    else:
        y = np.where(nan := np.isnan(y), 0.0, y)  # rule nan; the other values are still compared for the report
        q = (np.rint(y / s) + z).astype(np.int64)
    return got.astype(np.int64) - q, nan, qparams_match


def _unbiased(d: np.ndarray) -> bool:
    """Rule 4: ``|Σd| ≤ BIAS_Z·sqrt(Σd²) + 1 + BIAS_TIES·n``."""
    return abs(float(d.sum())) <= BIAS_Z * np.sqrt(float((d * d).sum())) + 1.0 + BIAS_TIES * max(d.size, 1)


@dataclass(frozen=True)
class Forced:
    """Eager at one quantizer in the forced run (the file's codes at every quantizer before it).

    Attributes:
        eager: Eager's ``(output, scale, zero_point)`` there.
        kernels: Kernel class of that run (``"integer-exact"`` where the integer reference computed the layer).
        steps: The derived path bound of this quantizer's own kernels (0 for ``integer-exact``; inf if not derived).
    """

    eager: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    kernels: str
    steps: float


def judge_codes(b: Boundary, got: np.ndarray, eager: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                kernels: str, allowed_steps: float, upstream_mismatch: float, upstream_differing: float = 0.0,
                forced: Forced | None = None) -> QuantizerCodes | None:
    """The rules of the module docstring at one quantizer; None when the tensors do not compare.

    ``kernels``, ``allowed_steps``, ``upstream_*``: the free-running verdict's inputs (rule 2 with what it inherits,
    rule 3's ``p_in``), used where ``forced`` is None (that run could not be made) and for 16-bit codes.
    """
    compared = _differences(b, got, eager)
    own = _differences(b, got, forced.eager) if forced is not None else None
    if compared is None:
        return None
    d, nan, qparams_match = compared
    n = max(d.size, 1)
    identical, within_one = float((d == 0).sum()) / n, float((np.abs(d) <= 1).sum()) / n
    max_abs = float(np.abs(d).max(initial=0))
    sixteen = got.dtype.itemsize > 1  # 16-bit codes: float ulps upstream flip many of these fine steps
    kernels = "16-bit" if sixteen else kernels
    own_identical = own_max = None
    if own is not None and forced is not None and not sixteen:  # rules 2-4 on what this quantizer's kernels add
        kernels, d_own = forced.kernels, own[0]
        own_identical, own_max = float((d_own == 0).sum()) / n, float(np.abs(d_own).max(initial=0))
        base = MISMATCH_FLOAT_OWN if kernels == "float" else _ALLOWED[kernels]
        allowed_mismatch = base + (0.0 if kernels == "integer-exact" else MISMATCH_SLACK_CODES / n)
        allowed_steps, judged_steps = forced.steps, own_max
        mismatch_holds = 1.0 - own_identical <= allowed_mismatch
        unbiased = kernels not in ("exact", "integer", "integer-exact") or _unbiased(d_own)
    else:
        slack = 0.0 if kernels == "integer-exact" else MISMATCH_SLACK_CODES / n
        inherited = max(upstream_mismatch, min(1.0, upstream_differing / n))  # differing x fan-out: 0 if unknown
        allowed_mismatch = _ALLOWED[kernels] + MISMATCH_GAIN[kernels] * inherited + slack
        judged_steps, mismatch_holds = max_abs, 1.0 - identical <= allowed_mismatch
        unbiased = (kernels not in ("exact", "integer", "integer-exact") or upstream_mismatch > BIAS_MAX_UPSTREAM
                    or _unbiased(d))
    allowed_steps += FLOAT_EXTRA_STEPS if kernels == "float" else 0
    checks = (("nan", not nan.any()), ("qparams", qparams_match), ("steps", judged_steps <= allowed_steps),
              ("mismatch", mismatch_holds), ("bias", kernels == "16-bit" or unbiased))
    failed = next((name for name, holds in checks if not holds), None)
    return QuantizerCodes(f"quantize_dequantize_{b.call}", b.module, f"{b.node.name} ({b.node.op_type})", d.size,
                          identical, within_one, float(d.sum()) / n, max_abs, kernels, allowed_steps,
                          allowed_mismatch, qparams_match, failed or f"{kernels} kernels", failed is None,
                          own_identical, own_max)
