"""MiniLM W8A8 benchmark section: embedding fidelity and single-thread onnxruntime latency, ours vs peers.

``run(quick)`` returns a markdown section. Every row is an ONNX model executed by onnxruntime in the same
run: the fp32 export, onnxruntime's ``quantize_static`` / ``quantize_dynamic`` (per-tensor and per-channel),
NNCF transformer mode, and our configurations. Metrics (:mod:`benchmarks.minilm.harness`): mean / min cosine
and top-5 neighbour agreement of the 200 evaluation embeddings against the fp32 PyTorch model; latency is the
median batch-1 single-thread time (48 tokens), all models timed interleaved.

Usage: ``python -m benchmarks.run minilm w8a8 [--quick] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.results import SectionResult
from benchmarks.common.sections import run_sections
from benchmarks.common.settings import Settings
from benchmarks.common.study import add_settings_options
from benchmarks.minilm import harness as H
from benchmarks.minilm import ours, peers

__all__ = ["configure", "run", "run_part", "section", "w8a8_dynamic_config"]

CALIB_BATCH = 16


@dataclass
class _Row:
    name: str
    path: Path | None
    note: str = ""
    metrics: H.EmbeddingMetrics | None = None
    latency: float | None = None


def w8a8_dynamic_config() -> object:
    """``QuantizerConfig.presets.w8a8_dynamic()`` when the preset exists, else the same config built here."""
    from coreai_opt.config import QuantizerConfig

    if hasattr(QuantizerConfig.presets, "w8a8_dynamic"):
        return QuantizerConfig.presets.w8a8_dynamic()
    from coreai_opt.config.quantizer_config import OpConfig
    from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import dynamic_activation_spec
    from coreai_opt.quantization.spec import PerChannel, QuantizationSpec

    weight = QuantizationSpec(dtype="int8", qscheme="symmetric", granularity=PerChannel(0))
    return QuantizerConfig(weight=None, activation=None).set_op_kind(
        "linear", OpConfig(weight=weight, activation=dynamic_activation_spec()))


def _attempt(rows: list[_Row], name: str, fn: Callable[[], Path], note: str = "") -> None:
    start = time.perf_counter()
    try:
        path = fn()
        rows.append(_Row(name, path, note))
    except Exception as exc:  # noqa: BLE001 - a failed row is reported, the section goes on
        logging.getLogger(__name__).debug(traceback.format_exc())
        rows.append(_Row(name, None, f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
    logging.getLogger(__name__).info("%s: %.1f s", name, time.perf_counter() - start)


def run(quick: bool) -> str:
    """Run the MiniLM section and return it as markdown (``quick``: fewer of our rows, shorter timing)."""
    reason = H.minilm_available()
    if reason is not None:
        return f"## MiniLM W8A8 (issue 8)\n\nNot run: {reason}\n"
    from coreai_opt.api.algorithms.activation_stats import input_absmax, outlier_rows
    from coreai_opt.api.algorithms.calibration_search import search_calibration
    from coreai_opt.api.algorithms.sensitivity import keep_sensitive, sensitivity
    from coreai_opt.api.algorithms.smooth_quant import smooth_quant
    from coreai_opt.config import QuantizerConfig

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    model, _, cal, ev, reference, example = H.minilm_setup()
    batches = cal.batches(CALIB_BATCH)
    extra: list[str] = []
    rows: list[_Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = peers.export_float(model, example, work / "fp32.onnx")
        rows.append(_Row("fp32", fp32))
        pre = peers.preprocess(fp32, work / "pre.onnx")
        _attempt(rows, "ORT quantize_static (QDQ U8S8 per-channel, MinMax)",
                 lambda: peers.ort_static(pre, batches, work / "ort_static.onnx"))
        _attempt(rows, "ORT quantize_dynamic per-tensor", lambda: peers.ort_dynamic(pre, work / "dyn_pt.onnx", False))
        _attempt(rows, "ORT quantize_dynamic per-channel", lambda: peers.ort_dynamic(pre, work / "dyn_pc.onnx", True))
        _attempt(rows, "NNCF ModelType.TRANSFORMER", lambda: peers.nncf_transformer(fp32, batches, work / "nncf.onnx"))

        dyn_cfg = w8a8_dynamic_config()
        static_cfg = QuantizerConfig.presets.w8a8()

        def build(name: str, config: object, m: torch.nn.Module = model,
                  after: Callable[[torch.fx.GraphModule], None] | None = None) -> Path:
            prepared = ours.prepare_calibrate(m, config, example, batches)
            if after is not None:
                after(prepared)
            return ours.export(prepared, example, work / f"{name}.onnx")[1]

        _attempt(rows, "ours w8a8_dynamic", lambda: build("dyn", dyn_cfg))
        search = smooth_quant(model, batches, example, alpha="search", insert_mul=True)
        _attempt(rows, "ours w8a8_dynamic + SmoothQuant (α search, Mul at non-foldable sites)",
                 lambda: build("dyn_sq", dyn_cfg, search.model), "one Mul per non-foldable site")
        if not quick:
            fold = smooth_quant(model, batches, example, alpha=0.5)
            _attempt(rows, "ours w8a8_dynamic + SmoothQuant (α 0.5, fold only)",
                     lambda: build("dyn_sqf", dyn_cfg, fold.model), "6 foldable v→o pairs")
        report = None
        if not quick:
            sens_prepared = ours.prepare_calibrate(search.model, dyn_cfg, example, batches)
            report = sensitivity(sens_prepared, cal.batches(32))
        for k in (() if quick else (2, 4)):
            kept = keep_sensitive(dyn_cfg, report, k)
            _attempt(rows, f"ours w8a8_dynamic + SmoothQuant + {k} most sensitive linears float",
                     lambda kept=kept, k=k: build(f"dyn_sq_keep{k}", kept, search.model),
                     ", ".join(f"`{n}`" for n in report.most_sensitive(k)))
        _attempt(rows, "ours w8a8 static (minmax)", lambda: build("static", static_cfg))
        choices: dict[str, object] = {}
        choice_table: str | None = None

        def searched(prepared: torch.fx.GraphModule) -> None:
            choices["result"] = search_calibration(prepared, batches)

        _attempt(rows, "ours w8a8 static + per-layer calibration search",
                 lambda: build("static_cs", static_cfg, after=searched))
        if "result" in choices:
            rows[-1].note = "calculators chosen: " + ", ".join(
                f"{k} ×{v}" for k, v in sorted(choices["result"].counts().items()))
            choice_table = choices["result"].table()
        # The inserted smoothing Mul stays float: its constant operand must not be quantized as an activation.
        sq_static_cfg = QuantizerConfig.presets.w8a8().set_op_kind("mul", None)
        _attempt(rows, "ours w8a8 static + SmoothQuant (α search, Mul) + calibration search",
                 lambda: build("static_sq_cs", sq_static_cfg, search.model, after=searched),
                 "mul ops float")
        if "result" in choices and rows[-1].path is not None:
            rows[-1].note += "; calculators chosen: " + ", ".join(
                f"{k} ×{v}" for k, v in sorted(choices["result"].counts().items()))

        for row in rows:
            if row.path is not None:
                row.metrics = H.compare(reference, H.ort_embed(row.path, ev))
        timed = {r.name: r.path for r in rows if r.path is not None}
        lat = H.latency_ms(timed, ev, rounds=3 if quick else 6, runs_per_round=5 if quick else 10, threads=1)
        for row in rows:
            row.latency = lat.get(row.name)

        outliers = outlier_rows(input_absmax(model, batches))[:8]
        extra.append("Largest per-channel outliers at linear inputs (calibration set, fp32 model):\n")
        extra.append("| input of | max abs | median channel max | ratio | top channels |\n|---|---:|---:|---:|---|")
        extra += [f"| `{o.layer}` | {o.max_abs:.1f} | {o.median_channel_max:.2f} | {o.ratio:.1f} | "
                  f"{', '.join(map(str, o.top_channels))} |" for o in outliers]
        sites = search.sites
        foldable = [s for s in sites if s.site.foldable]
        extra.append(f"\nSmoothQuant sites: {len(sites)}, foldable without new ops: {len(foldable)} "
                     f"({', '.join(sorted({s.site.kind for s in foldable}))}); the others read a LayerNorm output "
                     "that also feeds the residual add, or a GELU output.\n")
        if report is not None:
            extra.append("Sensitivity (w8a8_dynamic + SmoothQuant, one linear quantized at a time), top 8:\n")
            extra.append("\n".join(report.table().splitlines()[:10]))
        extra.append("\n<details><summary>SmoothQuant sites (α search)</summary>\n\n" + search.table() + "\n</details>")
        if choice_table is not None:
            extra.append("\n<details><summary>Calibration search: calculator per activation quantizer (w8a8 static)"
                         "</summary>\n\n" + choice_table + "\n</details>")
    fp32_lat = next(r.latency for r in rows if r.name == "fp32")
    lines = ["## MiniLM W8A8 (issue 8)", "",
             f"all-MiniLM-L6-v2 sentence embeddings, {ev.input_ids.shape[0]} evaluation / {cal.input_ids.shape[0]} "
             f"calibration sentences (disjoint), {H.SEQ_LEN} tokens; onnxruntime CPU, latency batch 1, 1 thread.", "",
             "| model | mean cos | min cos | top-5 agree | latency ms | vs fp32 | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.metrics is None:
            lines.append(f"| {r.name} | — | — | — | — | — | {r.note} |")
            continue
        speed = f"{fp32_lat / r.latency:.2f}×" if r.latency and fp32_lat else "—"
        lines.append(f"| {r.name} | {r.metrics.mean_cosine:.4f} | {r.metrics.min_cosine:.4f} | "
                     f"{r.metrics.topk_agreement:.3f} | {r.latency:.2f} | {speed} | {r.note} |")
    return "\n".join(lines + [""] + extra) + "\n"


def section(settings: Settings) -> SectionResult:
    """The section as a :class:`SectionResult` (its own markdown tables as the body)."""
    text = run(settings.quick or settings.tiny)
    heading, _, body = text.partition("\n")
    title = heading.removeprefix("## ").strip() if heading.startswith("## ") else "MiniLM W8A8"
    return SectionResult("minilm", title, body=body if heading.startswith("## ") else text)


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.run minilm w8a8``."""
    add_settings_options(parser, None, work_dir=False, latency=False)


def run_part(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    """Run the section and ``write`` its results page."""
    return run_sections({"minilm": section}, args, write)
