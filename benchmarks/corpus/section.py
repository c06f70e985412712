"""Section: the real-architecture corpus (issue 13), ours vs onnxruntime's ``quantize_static`` on 40 models.

Per model (:mod:`benchmarks.corpus.runner`): where our pipeline stops, verify_onnx's verdict, SQNR against the float
model for both quantized files in onnxruntime, integer conv/matmul kernels in onnxruntime's optimised graph, the
latency ratio (1 thread, batch 1, interleaved; skipped with ``--no-latency``), the seconds of each stage and
``export_onnx``'s seconds over the float dynamo export's (:func:`export_ratio`; issue 13 asks for at most 1.5×; the
float export keeps only the batch dynamic, ours also the sequence axis of a captured text model, which the ratio
includes).
``--quick`` runs the four models of the default test run, ``--tiny`` one of them. Every row is also appended to
``<work dir>/corpus/rows.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from benchmarks.common.results import SectionResult, Table
from benchmarks.common.settings import Settings
from benchmarks.corpus.models import CORPUS
from benchmarks.corpus.runner import CorpusRow, RunOptions, run_corpus_model

QUICK_MODELS = ("hf-convnext", "hf-distilbert", "hf-opt", "hf-deit")
SQNR_MARGIN_DB = 0.5
LATENCY_MARGIN = 1.05


def _models(settings: Settings) -> list[str]:
    if settings.tiny:
        return list(QUICK_MODELS[:1])
    return list(QUICK_MODELS) if settings.quick else list(CORPUS)


def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pair(a: object, b: object) -> str:
    return f"{'–' if a is None else a} / {'–' if b is None else b}"


def _verify(row: CorpusRow) -> str:
    if row.verify_ok is None:
        return "–"
    top1 = "" if row.top1_verify is None else f", top-1 {100 * row.top1_verify:.1f} %"
    return f"{'ok' if row.verify_ok else 'NOT ok'} ({_num(row.verify_steps)} steps{top1})"


def _latency(row: CorpusRow) -> str:
    ms = row.latency_ms
    if not ms:
        return "–"
    return f"{ms['ours'] / ms['ort']:.2f}× ({ms['ours']:.2f} / {ms['ort']:.2f} ms; fp32 {ms['fp32']:.2f})"


def export_ratio(row: CorpusRow) -> float | None:
    """Seconds of our ``export_onnx`` over those of the float dynamo export of the same model (issue 13: <= 1.5)."""
    ours, float_export = row.seconds.get("export"), row.seconds.get("ort_float_export")
    return None if ours is None or not float_export else ours / float_export


def _export_seconds(row: CorpusRow) -> str:
    ratio = export_ratio(row)
    return _num(row.seconds.get("export")) + ("" if ratio is None else f" ({ratio:.1f}×)")


def _pipeline_seconds(row: CorpusRow) -> str:
    ours = sum(row.seconds.get(k, 0.0) for k in ("prepare", "calibrate", "convert", "export"))
    ort = sum(row.seconds.get(k, 0.0) for k in ("ort_float_export", "ort_quantize"))
    return f"{ours:.1f} / {ort:.1f}"


def _losses(row: CorpusRow) -> list[str]:
    out = []
    if row.failed_stage is not None:
        out.append(f"corpus {row.name}: our pipeline fails at {row.failed_stage} ({row.error})")
    elif not row.verify_ok:
        out.append(f"corpus {row.name}: verify_onnx not ok ({_num(row.verify_steps)} output steps)")
    if row.int_ours is not None and row.int_ort is not None and row.int_ours < row.int_ort:
        out.append(f"corpus {row.name}: {row.int_ours} integer kernels vs {row.int_ort} for quantize_static")
    if row.sqnr_ours is not None and row.sqnr_ort is not None and row.sqnr_ours < row.sqnr_ort - SQNR_MARGIN_DB:
        out.append(f"corpus {row.name}: SQNR {row.sqnr_ours:.1f} dB vs {row.sqnr_ort:.1f} dB for quantize_static")
    if row.latency_ms and row.latency_ms["ours"] > LATENCY_MARGIN * row.latency_ms["ort"]:
        out.append(f"corpus {row.name}: latency {_latency(row)} vs quantize_static")
    return out


def _summary(rows: list[CorpusRow]) -> Table:
    table = Table("Summary", ["measure", "ours", "ORT quantize_static"])
    ours_ok = sum(r.end_to_end_ok for r in rows)
    ort_ok = sum(r.ort_error is None for r in rows)
    table.add("end to end (ours: verify_onnx ok; ORT: a quantized model that runs)", f"{ours_ok}/{len(rows)}",
              f"{ort_ok}/{len(rows)}")
    both = [r for r in rows if r.int_ours is not None and r.int_ort is not None]
    table.add(f"integer conv/matmul kernels, summed over the {len(both)} models both produced",
              sum(r.int_ours for r in both), sum(r.int_ort for r in both))
    table.add("conv/matmul left in float, same models", sum(r.float_ours for r in both),
              sum(r.float_ort for r in both))
    sqnr = [r for r in rows if r.sqnr_ours is not None and r.sqnr_ort is not None]
    if sqnr:
        table.add(f"median SQNR vs float over {len(sqnr)} models (dB)",
                  _num(statistics.median(r.sqnr_ours for r in sqnr)), _num(statistics.median(r.sqnr_ort for r in sqnr)))
    ratios = [x for r in rows if (x := export_ratio(r)) is not None]
    if ratios:
        table.add(f"export_onnx s / float export s, median (max) over {len(ratios)} models",
                  f"{statistics.median(ratios):.2f}× ({max(ratios):.2f}×)", "–")
    return table


def run(settings: Settings) -> SectionResult:
    """Measure every corpus model of this run (see the module docstring)."""
    section = SectionResult("corpus", "Real-architecture corpus: ours vs onnxruntime quantize_static (w8a8)")
    options = RunOptions(latency=settings.latency)
    work = settings.work_dir / "corpus"
    rows = []
    for name in _models(settings):
        rows.append(run_corpus_model(CORPUS[name], work / name, options))
        with (work / "rows.jsonl").open("a", encoding="utf-8") as log:  # every measurement, for later analysis
            log.write(json.dumps({**dataclasses.asdict(rows[-1]), "status": rows[-1].status}) + "\n")
    table = Table(
        "Per model: `QuantizerConfig.presets.w8a8()`, default capture; ORT = quant_pre_process + quantize_static "
        "(QDQ, per-channel, U8S8, MinMax) of a float dynamo export; 4 calibration batches of 4, 2 evaluation "
        "batches of 8 (not seen in calibration)",
        ["model", "ours", "verify_onnx", "SQNR dB ours / ORT", "integer kernels ours / ORT",
         "float conv/matmul ours / ORT", "BN left", "latency ours / ORT", "export s (× float export)",
         "pipeline s ours / ORT"],
    )
    for row in rows:
        table.add(row.name, row.status, _verify(row), _pair(_num(row.sqnr_ours), _num(row.sqnr_ort)),
                  _pair(row.int_ours, row.int_ort), _pair(row.float_ours, row.float_ort),
                  "–" if row.batchnorm_ours is None else row.batchnorm_ours, _latency(row),
                  _export_seconds(row), _pipeline_seconds(row))
        section.losses += _losses(row)
        if row.ort_error:
            section.errors.append(f"{row.name}: ORT quantize_static failed: {row.ort_error}")
        if row.error:
            section.notes.append(f"{row.name}: {row.error}")
    section.tables = [_summary(rows), table]
    if not settings.latency:
        section.notes.append("latency not measured in this run (--no-latency)")
    unprocessed = [r.name for r in rows if r.ort_preprocessed is False]
    if unprocessed:
        section.notes.append("quant_pre_process failed, quantize_static ran on the float export as is: "
                             + ", ".join(unprocessed))
    return section
