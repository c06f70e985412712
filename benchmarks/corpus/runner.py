"""Run one corpus model through coreai_opt and, side by side, through onnxruntime's ``quantize_static``.

Ours: ``QuantizerConfig.presets.w8a8()`` with default capture: prepare → calibrate → convert → export_onnx →
verify_onnx. Peer: a float dynamo export of the same model (dynamic batch, opset 20) → ``quant_pre_process`` (shape
inference + optimisation; when it raises, the float file is quantized as exported and the row says so) →
``quantize_static`` (QDQ, ``per_channel=True``, uint8 activations, int8 weights, MinMax) on the same calibration
batches. Both quantized files run in onnxruntime on the same evaluation batches (never seen in calibration) and
are compared with the float torch model:

.. math::

    \\mathrm{SQNR} = 10 \\log_{10} \\frac{\\sum y^2}{\\sum (y - \\hat y)^2} \\;\\mathrm{dB}

Integer kernels are counted in onnxruntime's optimised graph (:func:`coreai_opt.onnx.verify.fusion_report`) for both
files. Top-1 agreement compares argmaxes over the last axis (classes, or the vocabulary at every position); a
disagreement between onnxruntime and eager counts as decisive unless it is a near tie by verify_onnx's rule.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import Tensor, nn

import coreai_opt as co
from benchmarks.common.latency import measure
from benchmarks.common.onnx_utils import FLOAT_OPSET, session
from benchmarks.corpus.models import CorpusModel
from coreai_opt.onnx.verify.output_comparison import OutputComparison

__all__ = ["CorpusRow", "RunOptions", "decisive_flips", "eager_outputs", "export_float", "input_dependence",
           "output_verdict", "quantize_static_peer", "run_corpus_model", "run_onnx", "sqnr_db", "top1_agreement"]

Batch = tuple[Tensor, ...]
STAGES = ("build", "prepare", "calibrate", "convert", "export", "verify")


@dataclass(frozen=True)
class RunOptions:
    """Sizes of one corpus run (the defaults keep a tiny model to a few seconds per stage).

    ``eval_batches = 8`` (64 images / sequences): the SQNR of 2 batches of 8 is too noisy for the 0.5 dB bar. On
    efficientnet-b0 the SQNR of consecutive 2-batch pairs spreads over 35.1–36.4 dB for quantize_static and
    34.8–36.1 dB for ours (identical qparams, weights and biases): the first pair put quantize_static 0.96 dB
    ahead, 24 batches 0.18 dB.
    """

    calib_batches: int = 4
    calib_batch: int = 4
    eval_batches: int = 8
    eval_batch: int = 8
    latency: bool = False
    latency_rounds: int = 5
    latency_runs_per_round: int = 4
    seed: int = 0


@dataclass
class CorpusRow:
    """What one model measured; ``None`` where a stage did not run."""

    name: str
    family: str
    failed_stage: str | None = None  # ours: the first stage that raised
    error: str | None = None
    verify_ok: bool | None = None
    verify_steps: float | None = None  # max |ORT - eager| in output quantization steps (None: float output)
    verify_reason: str | None = None  # verify not ok: the first failing quantizer, else the failing outputs' reasons
    top1_verify: float | None = None  # ours in ORT vs ours in eager
    decisive_flips: int | None = None  # of those disagreements, the ones that are not near ties (see decisive_flips)
    top1_ours_float: float | None = None  # ours in ORT vs the float model
    top1_ort_float: float | None = None  # quantize_static in ORT vs the float model
    sqnr_ours: float | None = None
    sqnr_ort: float | None = None
    int_ours: int | None = None  # integer conv / matmul kernels in onnxruntime's optimised graph
    int_ort: int | None = None
    float_ours: int | None = None  # conv / matmul left in float
    float_ort: int | None = None
    other_int_ours: dict[str, int] = field(default_factory=dict)
    other_int_ort: dict[str, int] = field(default_factory=dict)
    batchnorm_ours: int | None = None  # BatchNormalization nodes in our exported file
    tolerance: float | None = None  # verify_onnx's absolute tolerance of our output
    ort_error: str | None = None
    ort_preprocessed: bool | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)  # fp32 / ours / ort, 1 thread, batch 1

    @property
    def end_to_end_ok(self) -> bool:
        """prepare → calibrate → convert → export_onnx → verify_onnx ran and verify_onnx said ok."""
        return self.failed_stage is None and bool(self.verify_ok)

    @property
    def status(self) -> str:
        """``ok``, ``verify not ok`` or ``<stage> failed``."""
        if self.failed_stage is not None:
            return f"{self.failed_stage} failed"
        return "ok" if self.verify_ok else "verify not ok"


def sqnr_db(reference: Sequence[np.ndarray], approx: Sequence[np.ndarray]) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference`` over all batches, in dB."""
    signal = sum(float(np.square(r.astype(np.float64)).sum()) for r in reference)
    noise = sum(float(np.square(r.astype(np.float64) - a.astype(np.float64)).sum())
                for r, a in zip(reference, approx, strict=True))
    return float("inf") if noise == 0.0 else 10.0 * float(np.log10(signal / noise))


def input_dependence(outputs: Sequence[np.ndarray]) -> float:
    """How much a model's output depends on its input: across-sample std over overall std, in [0, ~1].

    ``outputs`` are batches of one output, samples along axis 0. Every output position's standard deviation over
    the samples, averaged over positions, divided by the standard deviation of all values: 0 when every sample gets
    the same output (a random-init model whose BatchNorm constants swamp its signal), about 1 when the output varies
    with the input as much as it does across positions. SQNR against such a constant output ranks nothing.
    """
    flat = np.concatenate([o.reshape(o.shape[0], -1) for o in outputs]).astype(np.float64)
    overall = float(flat.std())
    return 0.0 if overall == 0.0 else float(flat.std(0).mean()) / overall


def top1_agreement(reference: Sequence[np.ndarray], other: Sequence[np.ndarray]) -> float:
    """Fraction of rows (all leading positions) whose argmax over the last axis agrees."""
    same = sum(int((r.argmax(-1) == o.argmax(-1)).sum()) for r, o in zip(reference, other, strict=True))
    total = sum(r[..., 0].size for r in reference)
    return same / total


def decisive_flips(reference: Sequence[np.ndarray], other: Sequence[np.ndarray], tolerance: float) -> int:
    """Argmax disagreements whose reference top-2 margin exceeds ``2 · tolerance`` (not near ties).

    ``verify_onnx`` forgives a flip when both logits may have moved by its tolerance; this applies the same rule
    to every position of LM logits (verify_onnx only judges 2-D ``[N, C]`` outputs).
    """
    count = 0
    for r, o in zip(reference, other, strict=True):
        top2 = np.sort(r, axis=-1)[..., -2:]
        count += int(((r.argmax(-1) != o.argmax(-1)) & (top2[..., 1] - top2[..., 0] > 2 * tolerance)).sum())
    return count


def _short(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines)[:500]}"


class _Timer:
    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start


class _Reader:
    """onnxruntime CalibrationDataReader over tuples of torch tensors."""

    def __init__(self, names: Sequence[str], batches: Sequence[Batch]) -> None:
        self._feeds = [{n: t.numpy() for n, t in zip(names, b, strict=True)} for b in batches]
        self._iter = iter(self._feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def rewind(self) -> None:
        self._iter = iter(self._feeds)


def run_onnx(path: Path, names: Sequence[str], batches: Sequence[Batch]) -> list[np.ndarray]:
    """The first output of the ONNX model at ``path`` on each batch (onnxruntime, 1 thread)."""
    sess = session(path, threads=1)
    return [sess.run(None, {n: t.numpy() for n, t in zip(names, b, strict=True)})[0] for b in batches]


def eager_outputs(model: nn.Module, batches: Sequence[Batch]) -> list[np.ndarray]:
    """``model``'s output on each batch, without gradients."""
    with torch.no_grad():
        return [model(*b).detach().numpy() for b in batches]


def export_float(model: nn.Module, example: Batch, names: Sequence[str], path: Path,
                 dynamic_shapes: tuple[dict[int, Any], ...] | None = None) -> Path:
    """Float dynamo export, weights inside the file; dynamic axes ``dynamic_shapes`` (default: a batch dimension
    shared by every input)."""
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, str(path), dynamo=True, opset_version=FLOAT_OPSET, external_data=False,
                          verbose=False, input_names=list(names), output_names=["output"],
                          dynamic_shapes=dynamic_shapes or tuple({0: batch} for _ in example))
    return path


def quantize_static_peer(float_path: Path, names: Sequence[str], calib: Sequence[Batch], out: Path) -> bool:
    """Preprocess (when onnxruntime's pre-processing succeeds) and quantize; return whether it was preprocessed."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = float_path.with_suffix(".pre.onnx")
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(str(float_path), str(pre), skip_symbolic_shape=False)
        source, preprocessed = pre, True
    except Exception:  # noqa: BLE001 - symbolic shape inference fails on some graphs: quantize the export as is
        source, preprocessed = float_path, False
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(source), str(out), _Reader(names, calib), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
    return preprocessed


def _ours(entry: CorpusModel, model: nn.Module, calib: list[Batch], evals: list[Batch], path: Path,
          row: CorpusRow, timer: _Timer) -> Callable[[], object] | None:
    """Our pipeline; records the failing stage and returns None on failure, else the converted model."""
    stage = "prepare"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with timer.stage("prepare"):
                prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), calib[0])
            stage = "calibrate"
            with timer.stage("calibrate"):
                co.calibrate(prepared, calib, progress=False)
            stage = "convert"
            with timer.stage("convert"):
                converted = co.convert(prepared)
            stage = "export"
            with timer.stage("export"):
                co.export_onnx(converted, calib[0], path, input_names=list(entry.input_names))
            stage = "verify"
            with timer.stage("verify"):
                report = co.verify_onnx(converted, path, evals)
    except Exception as exc:  # noqa: BLE001 - a failing stage is a measurement, not a crash of the run
        row.failed_stage, row.error = stage, _short(exc)
        return None
    output = report.outputs[0]
    row.verify_ok, row.verify_steps = report.ok, output.max_diff_steps
    if not report.ok:
        first = report.first_failing_quantizer
        row.verify_reason = str(first) if first is not None else "; ".join(
            output_verdict(o) for o in report.outputs if not o.ok)
    row.tolerance = output.tolerance
    row.int_ours, row.float_ours = report.fusion.num_integer_compute, report.fusion.num_float_compute
    row.other_int_ours = dict(report.fusion.other_quantized)
    row.batchnorm_ours = sum(n.op_type == "BatchNormalization" for n in onnx.load(str(path)).graph.node)
    return converted


def output_verdict(output: OutputComparison) -> str:
    """One failing output: its difference against the bound, the argmax verdict, then why that bound."""
    size = (f"{output.max_diff_steps:.3g} of {output.tolerance_steps} steps" if output.max_diff_steps is not None
            and output.tolerance_steps is not None else f"|diff| {output.max_abs_diff:.3g} of {output.tolerance:.3g}")
    flips = f"; argmax: {output.argmax_flips}" if output.argmax_flips else ""
    return f"{output.name}: {size}{flips} ({output.reason})"


def run_corpus_model(entry: CorpusModel, work_dir: Path, options: RunOptions = RunOptions(),
                     row: CorpusRow | None = None) -> CorpusRow:
    """Measure ``entry`` (see the module docstring); never raises for a failing stage, the row records it.

    ``row``: the row to fill (a caller that may interrupt the run keeps what was measured); default a new one.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    row = row if row is not None else CorpusRow(entry.name, entry.family)
    timer = _Timer(row.seconds)
    torch.manual_seed(options.seed)
    try:
        with timer.stage("build"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = entry.build().eval()
    except Exception as exc:  # noqa: BLE001
        row.failed_stage, row.error = "build", _short(exc)
        return row
    gen = torch.Generator().manual_seed(options.seed + 1)
    try:  # the entry's inputs and one float run of them are the entry's own (the catalog's), not a stage of ours
        with timer.stage("float reference"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calib = [entry.inputs(gen, options.calib_batch) for _ in range(options.calib_batches)]
            evals = [entry.inputs(gen, options.eval_batch) for _ in range(options.eval_batches)]
            reference = eager_outputs(model, evals)
    except Exception as exc:  # noqa: BLE001
        row.failed_stage, row.error = "build", f"the float model does not run on the entry's inputs: {_short(exc)}"
        return row
    names = entry.input_names

    ours_path = work_dir / f"{entry.name}.ours.onnx"
    converted = _ours(entry, model, calib, evals, ours_path, row, timer)
    if converted is not None:
        ours_out = run_onnx(ours_path, names, evals)
        row.sqnr_ours = sqnr_db(reference, ours_out)
        if entry.has_logits:
            eager = eager_outputs(converted, evals)
            row.top1_verify = top1_agreement(eager, ours_out)
            row.decisive_flips = decisive_flips(eager, ours_out, row.tolerance)
            row.top1_ours_float = top1_agreement(reference, ours_out)

    float_path, ort_path = work_dir / f"{entry.name}.float.onnx", work_dir / f"{entry.name}.ort.onnx"
    try:
        with timer.stage("ort_float_export"):
            export_float(model, calib[0], names, float_path)
        with timer.stage("ort_quantize"):
            row.ort_preprocessed = quantize_static_peer(float_path, names, calib, ort_path)
        ort_out = run_onnx(ort_path, names, evals)
        row.sqnr_ort = sqnr_db(reference, ort_out)
        if entry.has_logits:
            row.top1_ort_float = top1_agreement(reference, ort_out)
        fusion = co.fusion_report(ort_path)
        row.int_ort, row.float_ort = fusion.num_integer_compute, fusion.num_float_compute
        row.other_int_ort = dict(fusion.other_quantized)
    except Exception as exc:  # noqa: BLE001
        row.ort_error = _short(exc)
    if options.latency and converted is not None and row.ort_error is None:
        _latency(row, evals[0], {"fp32": float_path, "ours": ours_path, "ort": ort_path}, options)
    return row


def _latency(row: CorpusRow, batch: Batch, models: dict[str, Path], options: RunOptions
             ) -> None:
    """1 thread, batch 1, variants interleaved (:func:`benchmarks.common.latency.measure`)."""
    feed = [t[:1].numpy() for t in batch]
    timings = measure(models, feed, threads=1, rounds=options.latency_rounds,
                      runs_per_round=options.latency_runs_per_round)
    row.latency_ms = {label: t.median_ms for label, t in timings.items()}
