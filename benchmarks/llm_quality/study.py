"""Held-out perplexity of a small trained Llama-style LM: fp32, our w8a8 / w4 (each rounding) / w4 int8 compute,
and onnxruntime-genai's builder int4 on the same weights (issue 32).

Usage::

    python -m benchmarks.run llm_quality                         # trains once (cached), ~25 min on a loaded box
    python -m benchmarks.run llm_quality --only "ours w4 (default: gptq, asym, b32)" --output /tmp/R.md
    python -m benchmarks.run llm_quality --genai-python /path/to/venv/bin/python

Every ONNX file is scored in onnxruntime (1 thread) on the same windows (:mod:`benchmarks.llm_quality.perplexity`);
fp32 is also scored in PyTorch. Our rows are built in ``--jobs`` worker processes, each row in one process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common.results_file import write_page
from benchmarks.common.study import quiet_libraries

__all__ = ["Row", "configure", "run"]

DEFAULT_OUTPUT = Path(__file__).with_name("RESULTS.md")
DEFAULT_CACHE = Path.home() / ".cache" / "coreai_opt_benchmarks" / "llm_quality"
DEFAULT_GENAI_PYTHON = Path("/tmp/llmwork/genai-venv/bin/python")
#: Tokens per scored window (each predicts ``WINDOW - 1``).
WINDOW = 256
#: Calibration prompts (windows of the training tokens) and their length.
CALIBRATION_PROMPTS, CALIBRATION_LENGTH = 16, 128


@dataclass(frozen=True)
class Row:
    """One scored model."""

    label: str
    where: str  # "PyTorch" or "onnxruntime"
    nll: float
    tokens: int
    size: int | None  # bytes on disk (ONNX + external data)
    seconds: float | None  # build time (quantize + export, or the builder's run)
    error: str | None = None
    window_nll: tuple[float, ...] = ()  # each scored window's summed NLL, same order for every row

    @property
    def perplexity(self) -> float:
        from benchmarks.llm_quality.perplexity import perplexity

        return perplexity(self.nll, self.tokens)


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options."""
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report (default: RESULTS.md)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="trained model cache (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None, help="ONNX files (default: <cache>/onnx)")
    parser.add_argument("--genai-python", type=Path, default=DEFAULT_GENAI_PYTHON,
                        help="a Python with onnxruntime-genai, transformers, torch, onnx, onnx_ir (the builder)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    parser.add_argument("--only", nargs="+", default=None, help="our rows to run (labels); default all")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for our rows")
    parser.add_argument("--from-rows", type=Path, default=None,
                        help="rewrite the report from a previous run's rows.json (no building or scoring)")


def _windows(ids: torch.Tensor, max_tokens: int | None) -> list[torch.Tensor]:
    from benchmarks.llm_quality.perplexity import windows

    return windows(ids if max_tokens is None else ids[:max_tokens], WINDOW)


def _calibration_prompts(training: torch.Tensor) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, training.numel() - CALIBRATION_LENGTH, (CALIBRATION_PROMPTS,), generator=generator)
    return [training[s:s + CALIBRATION_LENGTH] for s in starts.tolist()]


def _our_row(folder: Path, label: str, prompts: list[torch.Tensor], scored: list[torch.Tensor], output: Path,
             head_dim: int) -> Row:
    """Worker: build one of our variants and score it (its own process)."""
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    quiet_libraries()
    torch.set_num_threads(1)
    from benchmarks.llm_quality.perplexity import onnx_logits, score
    from benchmarks.llm_quality.variants import OUR_VARIANTS, build_ours

    variant = next(v for v in OUR_VARIANTS if v.label == label)
    try:
        built = build_ours(folder, variant, prompts, output)
        result = score(onnx_logits(built.path, head_dim), scored)
    except Exception as exc:  # a failing row is reported in the table, the others still run
        return Row(label, "onnxruntime", float("nan"), 0, None, None, f"{type(exc).__name__}: {exc}"[:300])
    return Row(label, "onnxruntime", result.nll, result.tokens, built.size, built.seconds, None, result.windows)


def _builder_row(args: argparse.Namespace, folder: Path, precision: str, work: Path, scored: list[torch.Tensor],
                 head_dim: int) -> Row:
    from benchmarks.llm_quality.perplexity import onnx_logits, score
    from benchmarks.llm_quality.variants import build_with_builder

    label = f"onnxruntime-genai builder {precision}"
    try:
        built = build_with_builder(args.genai_python, folder, precision, work / f"builder-{precision}",
                                   work / "builder-cache")
        result = score(onnx_logits(built.path, head_dim), scored)
    except Exception as exc:
        return Row(label, "onnxruntime", float("nan"), 0, None, None, f"{type(exc).__name__}: {exc}"[:300])
    return Row(label, "onnxruntime", result.nll, result.tokens, built.size, built.seconds, None, result.windows)


def run(args: argparse.Namespace) -> int:
    """Train (or load), build every row, score it, write the report; 0 when the acceptance holds."""
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    quiet_libraries()
    from transformers import AutoModelForCausalLM

    from benchmarks.llm_quality.perplexity import eager_logits, score
    from benchmarks.llm_quality.train import trained_lm
    from benchmarks.llm_quality.variants import OUR_VARIANTS

    start = time.perf_counter()
    lm = trained_lm(args.cache, log=lambda line: print(line, flush=True))
    work = args.work_dir or args.cache / "onnx" / lm.folder.name
    work.mkdir(parents=True, exist_ok=True)
    scored = _windows(lm.held_out_ids, args.max_tokens)
    prompts = _calibration_prompts(lm.training_ids)
    head_dim = int(lm.record["model"]["head_dim"])
    if args.from_rows is not None:
        rows = [Row(**{**r, "window_nll": tuple(r.get("window_nll", ()))})
                for r in json.loads(args.from_rows.read_text())]
        report, ok = _report(lm, rows, scored, prompts, None)
        write_page(args.output, report)
        print(f"wrote {args.output} from {args.from_rows}")
        return 0 if ok else 1
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(lm.folder).eval()
    fp32 = score(eager_logits(model), scored)
    rows = [Row("fp32", "PyTorch", fp32.nll, fp32.tokens, None, None, None, fp32.windows)]
    print(f"fp32 (PyTorch): perplexity {fp32.perplexity:.4f} on {fp32.tokens} tokens", flush=True)
    for precision in ("fp32", "int4"):
        rows.append(_builder_row(args, lm.folder, precision, work, scored, head_dim))
        print(_line(rows[-1]), flush=True)
    labels = [v.label for v in OUR_VARIANTS if args.only is None or v.label in args.only]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = [pool.submit(_our_row, lm.folder, label, prompts, scored, work / f"ours-{i}.onnx", head_dim)
                   for i, label in enumerate(labels)]
        for future in futures:
            rows.append(future.result())
            print(_line(rows[-1]), flush=True)
    report, ok = _report(lm, rows, scored, prompts, time.perf_counter() - start)
    write_page(args.output, report)
    (work / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0 if ok else 1


def _line(row: Row) -> str:
    if row.error:
        return f"{row.label}: FAILED {row.error}"
    return f"{row.label}: perplexity {row.perplexity:.4f} ({row.size or 0} bytes, {row.seconds or 0:.0f} s)"


def _acceptance(rows: list[Row]) -> tuple[list[str], bool]:
    by_label = {r.label: r for r in rows if not r.error}
    fp32 = by_label["fp32"].perplexity
    default = by_label.get("ours w4 (default: gptq, asym, b32)")
    builder = by_label.get("onnxruntime-genai builder int4")
    ours_w4 = [r for label, r in by_label.items() if label.startswith("ours w4")]
    lines, ok = [], True
    if default and builder:
        holds = default.perplexity <= builder.perplexity
        ok &= holds
        tie = ""
        if default.window_nll and len(default.window_nll) == len(builder.window_nll):
            from benchmarks.llm_quality.perplexity import paired_interval

            _, low, high = paired_interval(np.array(default.window_nll), np.array(builder.window_nll), WINDOW - 1)
            if low <= 1.0 <= high:
                tie = (f" (but a tie on this text: the 95 % interval of the ratio, [{100 * (low - 1):+.3f}, "
                       f"{100 * (high - 1):+.3f}] %, holds 0)")
        lines.append(f"- our default w4 {default.perplexity:.4f} <= builder int4 {builder.perplexity:.4f}: "
                     f"**{'yes' if holds else 'no'}**{tie}")
    else:
        ok = False
        lines.append("- our default w4 vs builder int4: not measured (a row failed)")
    if ours_w4:
        best = min(ours_w4, key=lambda r: r.perplexity)
        gap = best.perplexity / fp32 - 1
        ok &= gap <= 0.02
        lines.append(f"- our best w4 ({best.label}) {best.perplexity:.4f} within 2 % of fp32 {fp32:.4f}: "
                     f"{100 * gap:+.3f} % **{'yes' if gap <= 0.02 else 'no'}**")
    return lines, ok


def _report(lm: Any, rows: list[Row], scored: list[torch.Tensor], prompts: list[torch.Tensor],
            seconds: float | None) -> tuple[str, bool]:
    from benchmarks.llm_quality.corpus import HELD_OUT_EVERY
    from benchmarks.llm_quality.perplexity import paired_interval

    record = lm.record
    fp32 = rows[0].perplexity
    builder = next((r for r in rows if r.label == "onnxruntime-genai builder int4" and not r.error), None)
    per_window = WINDOW - 1
    table = ["| model | run in | perplexity | vs fp32 | vs builder int4 [95 % interval] | file | build |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error:
            table.append(f"| {r.label} | {r.where} | failed: {r.error} | | | | |")
            continue
        size = f"{r.size / 2**20:.2f} MiB" if r.size else "(weights in memory)"
        built = f"{r.seconds:.0f} s" if r.seconds is not None else ""
        versus = ""
        if builder is not None and r is not builder and r.window_nll and len(r.window_nll) == len(builder.window_nll):
            ratio, low, high = paired_interval(np.array(r.window_nll), np.array(builder.window_nll), per_window)
            versus = f"{100 * (ratio - 1):+.3f} % [{100 * (low - 1):+.3f}, {100 * (high - 1):+.3f}]"
        table.append(f"| {r.label} | {r.where} | {r.perplexity:.4f} | {100 * (r.perplexity / fp32 - 1):+.3f} % | "
                     f"{versus} | {size} | {built} |")
    acceptance, ok = _acceptance(rows)
    settings = record["settings"]
    model = record["model"]
    wall = f"{seconds / 60:.0f} min wall" if seconds else "report rewritten from rows.json"
    text = f"""# llm_quality: held-out perplexity of a small trained LM, ours vs onnxruntime-genai's builder (issue 32)

Generated by `python -m benchmarks.run llm_quality` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, torch \
{torch.__version__}; {wall} on a shared 2-core machine).

## Model and data
- Model: Llama-style, {record['parameters'] / 1e6:.2f} M parameters: hidden {model['hidden_size']}, \
{model['num_hidden_layers']} layers, {model['num_attention_heads']} query / {model['num_key_value_heads']} key-value \
heads, MLP {model['intermediate_size']}, untied LM head, vocab {model['vocab_size']} (byte-level BPE trained with \
`tokenizers` on the training documents).
- Text: `pydoc_data.topics.topics` and the standard library's docstrings (read with `ast`): \
{record['documents']['training']} training / {record['documents']['held_out']} held-out documents (held out when \
`crc32(name) % {HELD_OUT_EVERY} == 0`), {record['training_tokens']} training tokens.
- Training: {settings['steps']} AdamW steps of {settings['batch']} x {settings['sequence']} tokens \
({record['tokens_seen']} tokens seen), lr {settings['learning_rate']}, warm-up then cosine decay, seed \
{settings['seed']}, {record['seconds']:.0f} s on {settings['threads']} thread; final training loss \
{record['loss_curve'][-1][1]:.3f}. Cached as a `save_pretrained` folder, so reruns skip training.
- Scored: {len(scored)} non-overlapping windows of {WINDOW} held-out tokens, each from an empty cache: \
**{rows[0].tokens} predicted tokens** (of a held-out stream of {lm.held_out_ids.numel()}). Perplexity = \
exp(sum of -log p(next token) / predicted tokens), log-softmax in float64, the same windows for every row.
- Calibration (ours): {len(prompts)} windows of {prompts[0].numel()} *training* tokens, each as a prefill plus \
4 greedy decode steps (as `coreai-opt quantize --task text-generation`). The builder takes no data.

## Results
{chr(10).join(table)}

vs builder int4: the perplexity ratio to the builder's int4 on the same windows, with a 95 % paired bootstrap
interval over the {len(scored)} windows (2000 resamples): an interval that holds 0 means the text scored cannot
tell the two apart. File: the ONNX file and its external data. Build: quantize + export wall time (ours:
prepare, calibrate, convert, export_onnx; the builder: its subprocess), measured with the rows built two at a time
on a loaded machine: read them as rough.

## Acceptance (issue 32)
{chr(10).join(acceptance)}

## What the rows say
{chr(10).join(_observations(rows))}

How the two int4 files differ (read from the files): the builder writes 21 `MatMulNBits` (q/k/v and gate/up fused,
the LM head included), block 32, symmetric (no zero points), `accuracy_level` 4, and leaves the embedding table
fp32; our default `w4` writes 29 `MatMulNBits` (one per linear, the LM head included), block 32, asymmetric (int4
zero points), `accuracy_level` 1 (4 with `compute="int8"`), GPTQ-rounded, and stores the embedding table as int4
blocks too, which is why its file is smaller.

Limits: the model is small and briefly trained (the minutes a shared 2-core machine allows), so its perplexity is
high and every 4-bit loss here is a fraction of a percent. The paired intervals say which differences this text
resolves; a ranking inside an interval that holds 0 is not established by this run.
"""
    return text, ok


def _observations(rows: list[Row]) -> list[str]:
    """Computed comparisons between rows (each line names the two rows it compares)."""
    by_label = {r.label: r for r in rows if not r.error}
    fp32 = by_label["fp32"].perplexity

    def gap(label: str) -> str:
        return f"{100 * (by_label[label].perplexity / fp32 - 1):+.3f} %"

    lines = []
    w4 = sorted((r for r in by_label.values() if r.label.startswith("ours w4")), key=lambda r: r.perplexity)
    if w4:
        lines.append("- Our w4 rows from best to worst (vs fp32): "
                     + ", ".join(f"{r.label.removeprefix('ours ')} {gap(r.label)}" for r in w4) + ".")
    pairs = (("ours w4, embedding float", "ours w4 (default: gptq, asym, b32)",
              "the embedding table kept float (as the builder does) instead of int4"),
             ("ours w4 compute=int8 (acc. level 4)", "ours w4 (default: gptq, asym, b32)",
              "int8 activations in MatMulNBits (accuracy level 4, the builder's) instead of float compute"),
             ("ours w4 rtn sym", "onnxruntime-genai builder int4",
              "our round-to-nearest symmetric b32 (embedding int4, float compute) vs the builder's RTN symmetric b32 "
              "(embedding float, int8 compute)"),
             ("ours w8a8_dynamic", "ours w8a8",
              "activation ranges computed from each tensor at run time instead of calibrated static ones"))
    for label, base, what in pairs:
        if label in by_label and base in by_label:
            a, b = by_label[label], by_label[base]
            lines.append(f"- {what}: {a.perplexity:.4f} vs {b.perplexity:.4f} ({gap(label)} vs {gap(base)} of "
                         f"fp32), file {(a.size or 0) / 2**20:.2f} vs {(b.size or 0) / 2**20:.2f} MiB.")
    return lines
