"""Study ``corpus``: the real-architecture corpus (issue 13), ours vs onnxruntime ``quantize_static`` per model.

:mod:`benchmarks.corpus.models` lists the 40 ``transformers`` / ``timm`` architectures, :mod:`benchmarks.corpus.runner`
measures one of them and :mod:`benchmarks.corpus.section` builds the tables.
"""

from __future__ import annotations

import argparse

from benchmarks.common.study import BENCHMARKS, Study, add_settings_options

__all__ = ["STUDY"]


def _configure(parser: argparse.ArgumentParser) -> None:
    add_settings_options(parser, BENCHMARKS / "corpus" / "RESULTS.md")


def _run(args: argparse.Namespace) -> int:
    from benchmarks.common.results_file import write_page
    from benchmarks.common.sections import run_sections
    from benchmarks.corpus import section

    return run_sections({"corpus": section.run}, args, lambda page: write_page(args.output, page))


STUDY = Study(
    name="corpus",
    measures="40 real transformers / timm architectures under w8a8: where the pipeline stops, verify_onnx, SQNR, "
             "integer kernels, latency and export time vs onnxruntime quantize_static",
    duration="not recorded for the 40 models; --quick runs 4 models, --tiny one",
    configure=_configure,
    run=_run,
)
