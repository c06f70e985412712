"""How one graph output of ``verify_onnx`` is judged: eager vs the runtime, over all batches, against its tolerance.

Each output gets the tolerance :func:`~coreai_opt.onnx.verify.tolerance.derive_tolerances` derived from the kernels
onnxruntime runs: a number of quantization steps of the output (the step read from the ``DequantizeLinear`` that
produces it, seen through value-preserving ops), a per-element bound behind an int8-compute ``MatMulNBits``, or a
fraction of the reference range for float outputs. :func:`compare_output` measures the largest difference, in
absolute terms and in steps, and the argmax agreement of class / vocabulary outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.verify.output_steps import OutputStep, element_steps
from coreai_opt.onnx.verify.tolerance import FLOAT_PRECISION, OutputTolerance

__all__ = ["FLOAT_ABSOLUTE_TOLERANCE", "MIN_ARGMAX_AGREEMENT", "MIN_AGREEMENT_ROWS", "OutputComparison",
           "compare_output", "output_steps_of"]

#: Absolute slack added to float tolerances (covers constant outputs, whose range is 0).
FLOAT_ABSOLUTE_TOLERANCE = 1e-6

#: Lowest argmax agreement of a class / token output, near-tie flips included: many near ties flipping at once are
#: a shift, not rounding (hf-llama with one activation Q/DQ pair dropped: 92.6 % of 1024 tokens, every flip within
#: the near-tie bound of 2 x 60 steps; clean corpus decoders 99.8-100 %).
MIN_ARGMAX_AGREEMENT = 0.995
#: :data:`MIN_ARGMAX_AGREEMENT` judges outputs with at least this many rows, where one flip costs at most the
#: 0.5 % the floor leaves; with fewer rows a single near tie would break it (clean timm-resnet18: 3 near-tie flips
#: of 64 rows, 95.3 %, from a random-initialised 64-px network that amplifies every rounding flip).
MIN_AGREEMENT_ROWS = 200

# Dequantized values are float32 products (q - z) * s, so an exact k-step difference measures k * (1 ± 2^-23).
_STEP_ROUNDING = 1e-3

# Ops that move values without changing them: a DequantizeLinear seen through them still defines the step.
_VALUE_PRESERVING = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


@dataclass(frozen=True)
class OutputComparison:
    """Eager vs the runtime for one graph output, over all batches.

    Attributes:
        name: ONNX output name.
        shape: Shape of the output of the first batch.
        max_abs_diff: Largest ``|runtime - eager|``.
        step: Per-tensor quantization step of the output (None for a float or per-channel-quantized output).
        max_diff_steps: Largest difference divided by the (per-element) step, None for float outputs.
        reference_range: ``max(eager) - min(eager)``.
        argmax_agreement: Fraction of rows whose argmax agrees (``[N, C>1]`` outputs; ``[B, T, V>1]`` outputs per
            token over the last axis), else None.
        argmax_flips_within_tolerance: Rows whose argmax differs but whose eager top-2 margin is within twice
            the output tolerance (near ties), else 0.
        argmax_flip_max_margin: The largest eager top-2 margin among the rows whose argmax flipped (None when none
            flipped): a flip is a near tie when this is at most ``argmax_tie_bound``.
        argmax_tie_bound: ``2 · tolerance``, the margin below which a flip is a near tie (None without an argmax).
        argmax_rows: Rows (classes: samples; tokens: positions) the argmax agreement counts (0 without one).
        ok: Within the derived tolerance, no decisive argmax flip and, over at least :data:`MIN_AGREEMENT_ROWS`
            rows, an argmax agreement of at least :data:`MIN_ARGMAX_AGREEMENT` (near ties included).
        rule: The tolerance rule that applied (``"exact"``, ``"steps"``, ``"float"``, ``"quantizer steps"``,
            ``"underived"``, ``"int8 compute"``; see :mod:`coreai_opt.onnx.verify.tolerance`).
        tolerance_steps: Allowed difference in steps (step rules), else None.
        tolerance: Allowed absolute difference (for per-element steps: at the coarsest step).
        reason: One line: why this tolerance (which kernels differ and how).
        on_file_codes: Where the free-running comparison failed, the same output with eager reading onnxruntime's
            codes at every quantizer (what the ops after the last quantizers add, the rest inherited from rounding
            flips the quantizer rules judge one by one); ``ok`` then holds when this one is within tolerance.
    """

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    step: float | None
    max_diff_steps: float | None
    reference_range: float
    argmax_agreement: float | None
    argmax_flips_within_tolerance: int
    ok: bool
    rule: str = "float"
    tolerance_steps: int | None = None
    tolerance: float = 0.0
    reason: str = ""
    argmax_flip_max_margin: float | None = None
    argmax_tie_bound: float | None = None
    argmax_rows: int = 0
    on_file_codes: OutputComparison | None = None

    @property
    def argmax_flips(self) -> str:
        """Why the argmax flips are forgiven, or not; ``""`` when no argmax flipped.

        E.g. ``"3 near-tie flip(s); largest eager top-2 margin of a flip 0.012 <= bound 0.05"``; a margin above the
        bound is marked decisive.
        """
        if self.argmax_flip_max_margin is None or self.argmax_tie_bound is None:
            return ""
        margin, bound = self.argmax_flip_max_margin, self.argmax_tie_bound
        relation = "<=" if margin <= bound else "> (decisive)"
        text = (f"{self.argmax_flips_within_tolerance} near-tie flip(s); largest eager top-2 margin of a flip "
                f"{margin:.3g} {relation} bound {bound:.3g}")
        if self.argmax_agreement is not None and self.argmax_agreement < MIN_ARGMAX_AGREEMENT and self.argmax_rows \
                >= MIN_AGREEMENT_ROWS:
            text += (f"; agreement {100 * self.argmax_agreement:.2f}% of {self.argmax_rows} rows is below "
                     f"{100 * MIN_ARGMAX_AGREEMENT:g}%: too many flips at once for rounding (a shift)")
        return text


def output_steps_of(model: onnx.ModelProto) -> dict[str, OutputStep]:
    """(scale, axis, dtype) of the DequantizeLinear producing each graph output, seen through value-preserving ops.

    A per-channel scale is only used when the DequantizeLinear produces the output directly (a reshape would
    move its axis).
    """
    graph = OnnxGraph(model)
    steps: dict[str, OutputStep] = {}
    for output in model.graph.output:
        node, moved = graph.producer(output.name), False
        while node is not None and node.op_type in _VALUE_PRESERVING:
            node, moved = graph.producer(node.input[0]), True
        view = QdqView.of(node, graph)
        if view is None or not view.is_dequantize or view.scale is None:
            continue
        scale = view.scale.astype(np.float64)
        dtype = view.quant_type if view.quant_type is not None else onnx.TensorProto.UINT8
        if scale.size == 1 or not moved:
            steps[output.name] = OutputStep(scale, view.axis, dtype)
    return steps


def _allowed(tolerance: OutputTolerance | None, step: OutputStep | None, ref_range: float) -> tuple[float, float]:
    """(allowed steps or inf, allowed absolute difference) of one output."""
    if tolerance is None:  # no derivation (an output onnxruntime's optimized graph does not name)
        return float("inf"), 0.02 * ref_range + FLOAT_ABSOLUTE_TOLERANCE
    if step is not None and tolerance.steps is not None and tolerance.rule in ("exact", "steps"):
        steps = tolerance.steps + _STEP_ROUNDING
        return steps, steps * float(np.max(step.scale))
    if tolerance.rule == "quantizer steps":
        return float("inf"), (tolerance.steps + _STEP_ROUNDING) * tolerance.source_step + FLOAT_ABSOLUTE_TOLERANCE
    if tolerance.rule == "exact" or tolerance.relative is None:  # "int8 compute": per element (_int8_allowed)
        return float("inf"), 0.0
    return float("inf"), tolerance.relative * ref_range + FLOAT_ABSOLUTE_TOLERANCE


def _int8_allowed(tolerance: OutputTolerance, step: OutputStep | None, units: list[np.ndarray],
                  refs: list[np.ndarray], ref_range: float) -> list[np.ndarray]:
    """Per element: ``steps · u + rounds · (quantizer step) + FLOAT_PRECISION · range`` (``"int8 compute"`` rule)."""
    own = float(np.max(step.scale)) if step is not None else (tolerance.source_step or 0.0)
    slack = tolerance.rounds * own + FLOAT_PRECISION * ref_range + FLOAT_ABSOLUTE_TOLERANCE
    allowed = []
    for unit, ref in zip(units, refs, strict=True):
        unit = unit if unit.shape == ref.shape else np.full(ref.shape, float(unit.max(initial=0.0)))
        allowed.append((tolerance.steps + _STEP_ROUNDING) * unit + slack)
    return allowed


def compare_output(name: str, refs: list[np.ndarray], gots: list[np.ndarray], step: OutputStep | None,
                   tolerance: OutputTolerance | None = None, units: list[np.ndarray] | None = None) -> OutputComparison:
    """Judge one output over all batches: eager ``refs`` vs runtime ``gots`` against the output's tolerance."""
    for ref, got in zip(refs, gots, strict=True):
        if ref.shape != got.shape:
            raise ValueError(f"output {name!r}: the runtime's shape {got.shape} differs from eager shape {ref.shape}")
    diffs = [np.abs(got.astype(np.float64) - ref.astype(np.float64)) for ref, got in zip(refs, gots, strict=True)]
    nonempty = [(ref, got, diff) for ref, got, diff in zip(refs, gots, diffs, strict=True) if ref.size]
    max_diff = max((float(diff.max()) for *_, diff in nonempty), default=0.0)
    lo = min((float(ref.min()) for ref, *_ in nonempty), default=0.0)
    ref_range = max((float(ref.max()) for ref, *_ in nonempty), default=0.0) - lo
    allowed_steps, tol = _allowed(tolerance, step, ref_range)
    max_steps = None
    if step is not None:
        own = [diff / element_steps(step, ref, got) for ref, got, diff in nonempty]
        max_steps = max((float(d.max()) for d in own), default=0.0)
    if tolerance is not None and tolerance.rule == "int8 compute" and units is not None:
        allowed = _int8_allowed(tolerance, step, units, refs, ref_range)
        ok = all(bool((diff <= a).all()) for diff, a in zip(diffs, allowed, strict=True))
        tol = max((float(a.max()) for a in allowed if a.size), default=0.0)
    elif step is not None and np.isfinite(allowed_steps):
        ok = max_steps <= allowed_steps
    else:
        ok = max_diff <= tol
    agreement, near_tie_flips, flip_margin, tie_bound, rows = None, 0, None, None, 0
    if refs[0].ndim in (2, 3) and refs[0].shape[-1] > 1:  # classes [N, C] or a vocabulary per token [B, T, V]
        rows_of = [(ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])) for ref, got in zip(refs, gots,
                                                                                                      strict=True)]
        rows = sum(ref.shape[0] for ref, _ in rows_of)
        flips = [ref.argmax(1) != got.argmax(1) for ref, got in rows_of]
        agreement = 1.0 - sum(int(f.sum()) for f in flips) / rows if rows else None
        margins = [np.diff(np.sort(ref, axis=1)[:, -2:], axis=1)[:, 0] for ref, _ in rows_of]  # top-1 minus top-2
        near_tie_flips = sum(int((f & (m <= 2 * tol)).sum()) for f, m in zip(flips, margins, strict=True))
        decisive_flips = sum(int(f.sum()) for f in flips) - near_tie_flips
        ok = ok and decisive_flips == 0
        if agreement is not None and rows >= MIN_AGREEMENT_ROWS:
            ok = ok and agreement >= MIN_ARGMAX_AGREEMENT
        tie_bound = 2 * tol
        flipped = [m[f] for f, m in zip(flips, margins, strict=True) if f.any()]
        flip_margin = max(float(m.max()) for m in flipped) if flipped else None
    step_value = float(step.scale.reshape(-1)[0]) if step is not None and step.scale.size == 1 else None
    if step is not None and step.is_float8:
        step_value = None  # float8 steps vary with the value
    rule = tolerance.rule if tolerance is not None else "underived"
    reason = tolerance.reason if tolerance is not None else "no derivation for this output: 0.02 of range"
    tolerance_steps = tolerance.steps if tolerance is not None and rule in ("exact", "steps") and step else None
    return OutputComparison(name, tuple(refs[0].shape), max_diff, step_value, max_steps, ref_range, agreement,
                            near_tie_flips, ok, rule, tolerance_steps, tol, reason, flip_margin, tie_bound, rows)
