"""Weight-only linears: float-compute vs int8-compute ``MatMulNBits`` (issue 15), latency and eager/ORT agreement.

``python -m benchmarks.run matmul_nbits [--quick]`` builds a GPT-style decoder (``dim`` 512, 4 blocks, an LM
head), quantizes it with ``w8`` and ``w4`` (block 32, RTN) at ``compute="float"`` and ``compute="int8"``, exports
each, checks it with ``verify_onnx`` and times every file against the fp32 export, interleaved round by round
(:mod:`benchmarks.common.latency`), batch 1 × 64 tokens and 8 × 64, one intra-op thread. It writes one Markdown row per
variant: ``MatMulNBits`` accuracy levels in the file, max |diff| / output range vs eager, top-1 agreement, and the
median latency ratio to fp32. Run it on a quiet machine: the ratios are what the speed claim rests on.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

import coreai_opt
from benchmarks.common.latency import measure
from benchmarks.common.onnx_utils import export_float, session
from benchmarks.common.results_file import write_page
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.reference_models import GPTStyleDecoder

VOCAB, SEQ = 2048, 64


def _levels(path: Path) -> str:
    levels = sorted({a.i for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"
                     for a in n.attribute if a.name == "accuracy_level"})
    return ",".join(map(str, levels)) or "-"


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.run matmul_nbits``."""
    parser.add_argument("--quick", action="store_true", help="tiny model and few rounds (a smoke run, no timing claim)")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("RESULTS.md"),
                        help="markdown table (default: benchmarks/matmul_nbits/RESULTS.md)")


def run(args: argparse.Namespace) -> int:
    """Quantize, export, verify and time every variant; write the table to ``args.output`` and print it."""
    torch.manual_seed(0)
    model = (GPTStyleDecoder(VOCAB, SEQ, 64, 1, 4) if args.quick else GPTStyleDecoder(VOCAB, SEQ, 512, 4, 8)).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(4)]
    evals = [torch.randint(0, VOCAB, (8, SEQ), generator=gen) for _ in range(2)]
    directory = Path(tempfile.mkdtemp(prefix="matmul_nbits_"))
    files = {"fp32": export_float(model, calib[0], directory / "fp32.onnx", input_name="tokens")}
    rows = []
    variants = [("w8", {}), ("w4", {"block_size": 32, "algorithm": "rtn"})]
    for preset, options in variants:
        for compute in ("float", "int8"):
            config = QuantizerConfig.presets.get(preset)(compute=compute, **options)
            prepared = coreai_opt.prepare(model, config, (calib[0],))
            coreai_opt.calibrate(prepared, calib, progress=False)
            converted = coreai_opt.convert(prepared)
            label = f"{preset} {compute}"
            path = export_onnx(converted, (calib[0],), directory / f"{preset}_{compute}.onnx")
            files[label] = path
            report = verify_onnx(converted, path, evals, localize=False)
            (out,) = report.outputs
            ort_session = session(path, 1)
            with torch.no_grad():
                agree = [float((converted(x).argmax(-1).numpy() == ort_session.run(None, {"tokens": x.numpy()})[0]
                                .argmax(-1)).mean()) for x in evals]
            rows.append((label, _levels(path), out.max_abs_diff / out.reference_range, report.ok, np.mean(agree)))
    rounds, runs = (2, 1) if args.quick else (12, 5)
    timings = {b: measure(files, np.random.default_rng(0).integers(0, VOCAB, (b, SEQ)), threads=1, rounds=rounds,
                          runs_per_round=runs) for b in (1, 8)}
    lines = ["| variant | MatMulNBits accuracy_level | max abs diff / range | top-1 agreement | verify ok | "
             "b1 latency / fp32 | b8 latency / fp32 |", "|---|---|---|---|---|---|---|"]
    for label, levels, rel, top1, ok in [(r[0], r[1], r[2], r[4], r[3]) for r in rows]:
        ratios = [timings[b][label].median_ms / timings[b]["fp32"].median_ms for b in (1, 8)]
        lines.append(f"| {label} | {levels} | {rel:.2e} | {top1:.1%} | {ok} | {ratios[0]:.2f} | {ratios[1]:.2f} |")
    text = f"`{args.command}`\n\n" + "\n".join(lines) + "\n"
    write_page(args.output, text)
    print(text)
    return 0
