"""The issue-18 table: MiniLM with 4-bit weights, every file executed by onnxruntime, ours vs every peer.

Two phases, so the slow builds can run on a loaded machine and the timing in a short quiet window:

* ``--build WORKDIR [--blocks 32,128]``: writes the fp32 export and every 4-bit file of
  :mod:`benchmarks.minilm.int4_variants` into WORKDIR, measures each one **in onnxruntime** on the held-out
  sentences (:mod:`benchmarks.minilm.harness`: mean / min cosine vs the fp32 torch model, top-5 neighbour
  agreement), and records its bytes, op counts as written and as onnxruntime runs it, and the
  ``accuracy_level`` of every ``MatMulNBits`` (:mod:`benchmarks.minilm.int4_graph_stats`) into WORKDIR/results.json,
  rewritten after every row. Rows already in results.json are kept (a re-run resumes; ``--rebuild`` redoes them);
  a row whose builder fails is recorded with its error and the run goes on.
* ``--time WORKDIR [--output PATH]``: times every file of results.json interleaved
  (:func:`benchmarks.common.latency.measure`: fresh sessions, 1 intra-op thread, ``ORT_ENABLE_ALL``), batch
  16 × 48 tokens and batch 1 × 48 tokens, and writes the markdown table with the latency ratios to fp32 (ratio of
  medians) next to the accuracy columns. Run it after ``--build`` has finished (both rewrite results.json).

``--tiny`` swaps MiniLM for a random 2-layer ``BertConfig`` (hidden 64) for a quick end-to-end check of the script.

Usage::

    python -m benchmarks.run minilm int4-onnx --build /tmp/int4bench_work --blocks 32,128
    python -m benchmarks.run minilm int4-onnx --time /tmp/int4bench_work --output /tmp/int4bench_work/table.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.latency import measure
from benchmarks.minilm import harness as H
from benchmarks.minilm import int4_variants as V
from benchmarks.minilm.int4_graph_stats import file_bytes, graph_stats

RESULTS = "results.json"
CALIB_BATCH = 16
#: Timing plan per batch size: (rounds, runs per round); the rounds are spread over 3 fresh session sets.
TIMING = {16: (6, 4), 1: (6, 12)}


def _load(tiny: bool) -> tuple[torch.nn.Module, object]:
    model, tokenizer = H.load_minilm()
    if not tiny:
        return model, tokenizer
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=64)
    return H.MiniLMEmbedder(transformers.BertModel(config, add_pooling_layer=False)).eval(), tokenizer


def _read(work: Path) -> dict:
    path = work / RESULTS
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"rows": {}}


def _write(work: Path, results: dict) -> None:
    tmp = work / (RESULTS + ".tmp")
    tmp.write_text(json.dumps(results, indent=1), encoding="utf-8")
    tmp.replace(work / RESULTS)


def _measure_row(path: Path, reference: np.ndarray, evaluation: H.Encoded, fp32_bytes: int | None) -> dict:
    metrics = H.compare(reference, H.ort_embed(path, evaluation))
    size = file_bytes(path)
    return {"file": path.name, "mean_cos": metrics.mean_cosine, "min_cos": metrics.min_cosine,
            "top5": metrics.topk_agreement, "bytes": size,
            "size_ratio": size / fp32_bytes if fp32_bytes else 1.0, "ops": graph_stats(path)}


def build(work: Path, blocks: list[int], tiny: bool, rebuild: bool, only: set[str] | None) -> dict:
    """Phase 1 (module docstring); returns the results dict also written to WORKDIR/results.json."""
    log = logging.getLogger(__name__)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, tokenizer = _load(tiny)
    calib = H.encode(tokenizer, H.read_sentences("calibration"))
    evaluation = H.encode(tokenizer, H.read_sentences("eval"))
    reference = H.torch_embed(model, evaluation)
    example = (calib.input_ids[:2], calib.attention_mask[:2])
    results = _read(work)
    results["meta"] = {"tiny": tiny, "calibration_sentences": int(calib.input_ids.shape[0]),
                       "eval_sentences": int(evaluation.input_ids.shape[0]), "seq_len": H.SEQ_LEN,
                       "torch": torch.__version__, **_versions()}
    rows = results["rows"]
    fp32_path = work / "fp32.onnx"
    if "fp32" not in rows or (rebuild and (not only or "fp32" in only)):
        start = time.perf_counter()
        V.export_float(model, example, fp32_path)
        rows["fp32"] = {"name": "fp32 ONNX", "block": None, "build_s": time.perf_counter() - start,
                        **_measure_row(fp32_path, reference, evaluation, None)}
        _write(work, results)
    fp32_bytes = rows["fp32"]["bytes"]
    inputs = V.Inputs(model, example, calib.batches(CALIB_BATCH), fp32_path)
    for variant in V.variants(blocks):
        if (only and variant.key not in only) or (variant.key in rows and not rebuild):
            continue
        log.info("building %s", variant.key)
        row: dict[str, object] = {"name": variant.name, "block": variant.block}
        start = time.perf_counter()
        try:
            path = variant.build(inputs, work / f"{variant.key}.onnx")
            row["build_s"] = time.perf_counter() - start
            row.update(_measure_row(path, reference, evaluation, fp32_bytes))
        except Exception as exc:  # noqa: BLE001 - a failed row is recorded with its error, the table goes on
            row["build_s"] = time.perf_counter() - start
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            log.info("%s failed:\n%s", variant.key, traceback.format_exc())
        rows[variant.key] = row
        results.get("latency", {}).pop(variant.key, None)  # a rebuilt file's old timing no longer applies
        log.info("%s: %s", variant.key, json.dumps({k: v for k, v in row.items() if k != "ops"}))
        _write(work, results)
    return results


def _versions() -> dict[str, str]:
    import onnxruntime

    versions = {"onnxruntime": onnxruntime.__version__}
    try:
        import nncf

        versions["nncf"] = nncf.__version__
    except ImportError:
        versions["nncf"] = "not installed"
    return versions


def time_all(work: Path, tiny: bool) -> dict:
    """Phase 2: latency per batch size for every built file; stores ``latency`` in results.json and returns it."""
    results = _read(work)
    rows = {k: r for k, r in results["rows"].items() if "file" in r}
    if "fp32" not in rows:
        raise FileNotFoundError(f"{work / RESULTS} has no fp32 row: run --build {work} first")
    _, tokenizer = _load(tiny)
    evaluation = H.encode(tokenizer, H.read_sentences("eval"))
    paths = {k: work / r["file"] for k, r in rows.items()}
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    latency: dict[str, dict[str, float]] = {}
    for batch, (rounds, runs) in TIMING.items():
        feed = [evaluation.input_ids[:batch].numpy(), evaluation.attention_mask[:batch].numpy()]
        timings = measure(paths, feed, threads=1, rounds=rounds, runs_per_round=runs)
        for key, t in timings.items():
            latency.setdefault(key, {})[f"b{batch}_ms"] = t.median_ms
            latency[key][f"b{batch}_ratio"] = t.median_ms / timings["fp32"].median_ms
    results["latency"] = latency
    results["timing"] = {"wall_s": time.perf_counter() - start, "loadavg_1min_before": load_before,
                         "loadavg_1min_after": os.getloadavg()[0],
                         "plan": {f"b{b}": {"rounds": r, "runs_per_round": n} for b, (r, n) in TIMING.items()}}
    _write(work, results)
    return results


def _fmt(value: object, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """The table: accuracy and size from ``--build``, latency ratios from ``--time`` (— when not timed)."""
    latency, meta, timing = results.get("latency", {}), results.get("meta", {}), results.get("timing")
    head = (f"{meta.get('eval_sentences')} held-out / {meta.get('calibration_sentences')} calibration sentences, "
            f"{meta.get('seq_len')} tokens{' (tiny random BERT)' if meta.get('tiny') else ''}; onnxruntime "
            f"{meta.get('onnxruntime')}, nncf {meta.get('nncf')}, torch {meta.get('torch')}. ")
    if timing:
        head += (f"Latency: 1 intra-op thread, ratio of the variant's median to fp32's, all files interleaved; "
                 f"timing took {timing['wall_s']:.0f} s at 1-min load {timing['loadavg_1min_before']:.1f} → "
                 f"{timing['loadavg_1min_after']:.1f}.")
    else:
        head += "Latency not measured yet (`--time`)."
    lines = [head, "", "| variant | block | mean cos | min cos | top-5 | size ratio | MatMulNBits (kernel) | "
             "GatherBlockQuantized | float linears (kernel) | accuracy_level (kernel) | b16 / fp32 | b1 / fp32 | "
             "build s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for key, r in results["rows"].items():
        if "error" in r:
            lines.append(f"| {r['name']} | {r['block']} | — | — | — | — | — | — | — | failed: {r['error'][:200]} "
                         f"| — | — | {r['build_s']:.0f} |")
            continue
        kernel, lat = r["ops"]["kernel"], latency.get(key, {})
        levels = ", ".join(f"{lv}: {n}" for lv, n in kernel["accuracy_levels"].items()) or "—"
        lines.append(
            f"| {r['name']} | {r['block'] or '—'} | {r['mean_cos']:.4f} | {r['min_cos']:.4f} | {r['top5']:.3f} | "
            f"{r['size_ratio']:.3f} | {kernel['MatMulNBits']} | {kernel['GatherBlockQuantized']} | "
            f"{kernel['float_linears']} | {levels} | {_fmt(lat.get('b16_ratio'), '.2f')} | "
            f"{_fmt(lat.get('b1_ratio'), '.2f')} | {r['build_s']:.0f} |")
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.run minilm int4-onnx`` (module docstring)."""
    phase = parser.add_mutually_exclusive_group(required=True)
    phase.add_argument("--build", type=Path, metavar="WORKDIR")
    phase.add_argument("--time", type=Path, metavar="WORKDIR")
    parser.add_argument("--blocks", default="32,128")
    parser.add_argument("--only", default=None, help="comma-separated row keys to build (default: all)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild rows already in results.json")
    parser.add_argument("--tiny", action="store_true", help="random 2-layer BERT instead of MiniLM")
    parser.add_argument("--output", type=Path, default=None, help="markdown table (default: the study's RESULTS.md)")


def run_part(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    """Run the phase chosen by ``--build`` / ``--time`` and ``write`` the table."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.build is not None:
        only = set(args.only.split(",")) if args.only else None
        results = build(args.build, [int(b) for b in args.blocks.split(",")], args.tiny, args.rebuild, only)
    else:
        results = time_all(args.time, args.tiny)
        logging.getLogger(__name__).info("timing took %.0f s", results["timing"]["wall_s"])
    write(markdown(results))
    return 0
