"""Run the benchmark sections and write benchmarks/RESULTS.md.

Usage::

    python -m benchmarks.run                      # full run (quiet machine, about half an hour on 2 cores)
    python -m benchmarks.run --quick              # ≤ 10 min on 2 cores: smaller batches, fewer repeats and rows
    python -m benchmarks.run --only speed accuracy --output /tmp/R.md
    python -m benchmarks.run --quick --only accuracy --tiny --output /tmp/R.md   # smoke test (tests/)
    python -m benchmarks.run --only corpus --no-latency --output /tmp/R.md     # the 40-model corpus, untimed
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import accuracy, corpus, fidelity, file_size, minilm, pipeline_cost, report, speed
from benchmarks.results import SectionResult, attempt
from benchmarks.settings import Settings
from benchmarks.torchvision_ops import declare_torchvision_ops


def _minilm_section(settings: Settings) -> SectionResult:
    """Issue 8: the pretrained MiniLM sentence encoder under W8A8 (its own markdown tables)."""
    text = minilm.run(settings.quick or settings.tiny)
    heading, _, body = text.partition("\n")
    title = heading.removeprefix("## ").strip() if heading.startswith("## ") else "MiniLM W8A8"
    return SectionResult("minilm", title, body=body if heading.startswith("## ") else text)


SECTIONS: dict[str, Callable[[Settings], SectionResult]] = {
    "accuracy": accuracy.run,
    "speed": speed.run,
    "cost": pipeline_cost.run,
    "size": file_size.run,
    "fidelity": fidelity.run,
    "minilm": _minilm_section,
    "corpus": corpus.run,
}
DEFAULT_OUTPUT = Path(__file__).with_name("RESULTS.md")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="≤ 10 min on 2 cores: fewer rows, batches, repeats")
    parser.add_argument("--tiny", action="store_true", help="one tiny case per section (used by the smoke test)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)})")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the markdown report")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep ONNX files here (default: a temp dir)")
    parser.add_argument("--no-latency", action="store_true",
                        help="skip the latency measurements of the corpus section (e.g. on a shared machine)")
    return parser.parse_args(argv)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "torch._dynamo", "torch.export", "nncf", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    declare_torchvision_ops()  # before anything imports transformers / timm (see benchmarks/torchvision_ops.py)
    started, t0 = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="coreai_bench_") as tmp:
        settings = Settings(quick=args.quick or args.tiny, tiny=args.tiny, work_dir=args.work_dir or Path(tmp),
                            torch_threads=1 if args.tiny else 2, latency=not args.no_latency)
        torch.set_num_threads(settings.torch_threads)
        results: list[SectionResult] = []
        for key in [k for k in SECTIONS if not args.only or k in args.only]:
            print(f"[benchmarks] {key} ...", flush=True)
            start = time.perf_counter()
            out = attempt(lambda key=key: SECTIONS[key](settings))
            section = out.value if out.ok else SectionResult(key, key, errors=[f"section failed: {out.error}"])
            section.seconds = time.perf_counter() - start
            results.append(section)
            print(f"[benchmarks] {key} done in {section.seconds:.0f} s", flush=True)
            report.write(args.output, results, command, started, time.perf_counter() - t0)
    report.write(args.output, results, command, started, time.perf_counter() - t0)
    print(f"[benchmarks] wrote {args.output} ({(time.perf_counter() - t0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
