"""Study ``comparison``: ours against onnxruntime ``quantize_static`` / ``quantize_dynamic`` and NNCF, side by side.

Small reference models (DigitsCNN on digits / MNIST, ResNet- and MobileNet-style CNNs, a transformer encoder), every
quantized file executed by onnxruntime. Sections (``--only``): ``accuracy`` (test accuracy on real data), ``speed``
(onnxruntime latency, variants interleaved, with what onnxruntime fused), ``cost`` (time and memory of each pipeline
stage), ``size`` (file bytes), ``fidelity`` (eager fake-quant vs onnxruntime, ``co.verify_onnx``).
"""

from __future__ import annotations

import argparse

from benchmarks.common.study import BENCHMARKS, Study, add_settings_options

__all__ = ["SECTIONS", "STUDY"]

#: Section keys in run order.
SECTIONS = ("accuracy", "speed", "cost", "size", "fidelity")


def _configure(parser: argparse.ArgumentParser) -> None:
    add_settings_options(parser, BENCHMARKS / "comparison" / "RESULTS.md", latency=False)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)})")


def _run(args: argparse.Namespace) -> int:
    from benchmarks.common.results_file import write_page
    from benchmarks.common.sections import run_sections
    from benchmarks.comparison import accuracy, fidelity, file_size, pipeline_cost, speed

    sections = {"accuracy": accuracy.run, "speed": speed.run, "cost": pipeline_cost.run, "size": file_size.run,
                "fidelity": fidelity.run}
    chosen = {key: fn for key, fn in sections.items() if not args.only or key in args.only}
    return run_sections(chosen, args, lambda page: write_page(args.output, page))


STUDY = Study(
    name="comparison",
    measures="ours vs onnxruntime quantize_static / quantize_dynamic and NNCF on small CNNs and a transformer: "
             "accuracy, latency, pipeline cost, file size, eager-vs-onnxruntime fidelity",
    duration="10.5 min full, 5.0 min --quick (recorded runs); the smoke case about 25 s",
    configure=_configure,
    run=_run,
)
