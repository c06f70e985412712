"""Study ``minilm``: the pretrained all-MiniLM-L6-v2 sentence encoder, ours vs onnxruntime and NNCF (issues 8, 18).

Four parts, each rewriting its own block of ``benchmarks/minilm/RESULTS.md`` (:func:`~benchmarks.common.results_file.
write_part`) or, with ``--output``, writing its table there instead:

* ``w8a8`` (:mod:`~benchmarks.minilm.w8a8`): int8 static and dynamic, SmoothQuant, calibration search, sensitivity;
  every file in onnxruntime, single-thread latency interleaved;
* ``int4-eager`` (:mod:`~benchmarks.minilm.int4_eager`): every weight-rounding algorithm × block × scheme × embeddings,
  fake-quantized in eager;
* ``int4-peers`` (:mod:`~benchmarks.minilm.int4_peers`): onnxruntime's ``MatMulNBitsQuantizer`` (RTN, HQQ);
* ``int4-onnx`` (:mod:`~benchmarks.minilm.int4_onnx`): the issue-18 table, ours vs every peer in onnxruntime, in two
  phases (``--build WORKDIR``, then ``--time WORKDIR`` in a quiet window).

Shared: :mod:`~benchmarks.minilm.harness` (model, sentences, metrics), :mod:`~benchmarks.minilm.ours` and
:mod:`~benchmarks.minilm.peers` (the pipelines), :mod:`~benchmarks.minilm.int4_variants` and
:mod:`~benchmarks.minilm.int4_graph_stats` (the int4 table's builders and op counts).
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial

from benchmarks.common.study import BENCHMARKS, Study

__all__ = ["PARTS", "STUDY"]

#: Part name -> its module (each defines ``configure(parser)`` and ``run_part(args, write) -> int``).
PARTS = {"w8a8": "w8a8", "int4-eager": "int4_eager", "int4-peers": "int4_peers", "int4-onnx": "int4_onnx"}
RESULTS = BENCHMARKS / "minilm" / "RESULTS.md"


def _module(part: str) -> object:
    return importlib.import_module(f"benchmarks.minilm.{PARTS[part]}")


def _configure(parser: argparse.ArgumentParser) -> None:
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART",
                                  help=f"which table to measure: {', '.join(PARTS)}")
    for part in PARTS:
        _module(part).configure(parts.add_parser(part, help=f"see benchmarks.minilm.{PARTS[part]}"))


def _write(args: argparse.Namespace, text: str) -> None:
    from benchmarks.common.results_file import write_page, write_part

    if args.output is not None:
        write_page(args.output, text)
    else:
        write_part(RESULTS, args.part, f"`{args.command}`\n\n{text}")


def _run(args: argparse.Namespace) -> int:
    code = _module(args.part).run_part(args, partial(_write, args))
    print(f"[benchmarks] minilm {args.part}: wrote {args.output or RESULTS}", flush=True)
    return code


STUDY = Study(
    name="minilm",
    measures="all-MiniLM-L6-v2 embeddings (cosine, top-5 neighbours vs fp32) and latency: W8A8 (w8a8) and 4-bit "
             "weights (int4-eager, int4-peers, int4-onnx), ours vs onnxruntime and NNCF",
    duration="w8a8 192 s (--quick 140 s), int4-onnx --time 212 s (recorded runs); int4-eager, int4-peers and "
             "int4-onnx --build: not recorded (every row prints its build seconds)",
    configure=_configure,
    run=_run,
)
