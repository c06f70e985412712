"""Study ``auto``: ``co.auto_quantize`` with defaults on MiniLM, a transformer encoder and the CNNs (issue 19)."""

from __future__ import annotations

import argparse

from benchmarks.common.study import BENCHMARKS, Study, add_settings_options

__all__ = ["STUDY"]


def _configure(parser: argparse.ArgumentParser) -> None:
    add_settings_options(parser, BENCHMARKS / "auto" / "RESULTS.md")


def _run(args: argparse.Namespace) -> int:
    from benchmarks.auto import section
    from benchmarks.common.results_file import write_page
    from benchmarks.common.sections import run_sections

    return run_sections({"auto": section.run}, args, lambda page: write_page(args.output, page))


STUDY = Study(
    name="auto",
    measures="co.auto_quantize next to the presets and onnxruntime quantize_dynamic: onnxruntime accuracy, "
             "timed latency (unless --no-latency) and the cost model's estimate",
    duration="3.2 min (recorded run, quiet machine)",
    configure=_configure,
    run=_run,
)
