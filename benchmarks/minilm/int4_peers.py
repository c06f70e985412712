"""onnxruntime's own 4-bit weight quantizers on MiniLM, on the same sentences as :mod:`benchmarks.minilm.int4_eager`.

``MatMulNBitsQuantizer`` with its DEFAULT (round-to-nearest, symmetric or asymmetric) and HQQ algorithms on the
fp32 export (:func:`benchmarks.minilm.int4_variants.ort_matmul_nbits`, the builder of the ONNX table's ORT rows);
embeddings stay float (it quantizes MatMul only), so compare with the ``embeddings float`` rows. Executed by
onnxruntime (MatMulNBits with fp32 compute, accuracy level 0).

Usage: ``python -m benchmarks.run minilm int4-peers [--output PATH] [--blocks 32,128]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.minilm import harness as H
from benchmarks.minilm import peers
from benchmarks.minilm.int4_variants import Inputs, ort_matmul_nbits

__all__ = ["configure", "run_part"]

#: (row name, onnxruntime algorithm, symmetric)
PEERS = (("ORT RTN sym", "rtn", True), ("ORT RTN asym", "rtn", False), ("ORT HQQ", "hqq", False))


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.run minilm int4-peers``."""
    parser.add_argument("--output", type=Path, default=None, help="markdown table (default: the study's RESULTS.md)")
    parser.add_argument("--blocks", default="32,128")


def run_part(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    """Quantize with every peer at every block size, measure in onnxruntime, ``write`` the table."""
    model, _, calib, evaluation, reference, example = H.minilm_setup()
    lines = ["| peer | block | mean cos | min cos | top-5 | build s |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = peers.export_float(model, example, work / "fp32.onnx")
        inputs = Inputs(model, example, [], fp32)  # RTN and HQQ are data-free
        for block in (int(b) for b in args.blocks.split(",")):
            for name, algorithm, symmetric in PEERS:
                start = time.perf_counter()
                level = 0 if algorithm == "rtn" else None
                build = ort_matmul_nbits(algorithm, block, symmetric, accuracy_level=level)
                path = build(inputs, work / f"{algorithm}{symmetric}{block}.onnx")
                seconds = time.perf_counter() - start
                m = H.compare(reference, H.ort_embed(path, evaluation))
                print(json.dumps({"peer": name, "block": block, "mean_cos": m.mean_cosine, "min_cos": m.min_cosine,
                                  "top5": m.topk_agreement, "build_s": seconds}), flush=True)
                lines.append(f"| {name} | {block} | {m.mean_cosine:.4f} | {m.min_cosine:.4f} | "
                             f"{m.topk_agreement:.3f} | {seconds:.1f} |")
    write("\n".join(lines) + "\n")
    return 0
