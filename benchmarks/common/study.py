"""What a study is to the one entry point ``python -m benchmarks.run NAME``: its name, folder, options and runner.

A study lives in ``benchmarks/<name>/`` and writes one results file, ``benchmarks/<name>/RESULTS.md``. Its package
``__init__`` defines ``STUDY``; :mod:`benchmarks.run` keeps the registry ``NAME -> Study``. The ``__init__`` imports
no heavy library (listing the studies must stay instant): the runner imports the study's modules when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BENCHMARKS", "Study", "add_settings_options", "quiet_libraries"]

#: The ``benchmarks/`` folder.
BENCHMARKS = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Study:
    """One study: ``configure`` adds its options to its sub-parser, ``run`` runs it and returns an exit code."""

    name: str
    measures: str  # one line: what it measures (``--list`` and benchmarks/README.md)
    duration: str  # how long it takes on the 2-core reference machine
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    @classmethod
    def from_module(cls, name: str, measures: str, duration: str, module: str, entry: str = "run") -> Study:
        """A study whose ``module`` defines ``configure(parser)`` and ``<entry>(args) -> int``.

        The module is imported when the study is configured or run, never when the studies are listed.
        """

        def configure(parser: argparse.ArgumentParser) -> None:
            importlib.import_module(module).configure(parser)

        def run(args: argparse.Namespace) -> int:
            return getattr(importlib.import_module(module), entry)(args)

        return cls(name, measures, duration, configure, run)

    @classmethod
    def one_section(cls, name: str, measures: str, duration: str, module: str) -> Study:
        """A study that is one section: ``module.run(settings)``, with the common options, written to its RESULTS.md.

        The section runs through :func:`benchmarks.common.sections.run_sections` (imported when the study runs).
        """

        def configure(parser: argparse.ArgumentParser) -> None:
            add_settings_options(parser, BENCHMARKS / name / "RESULTS.md")

        def run(args: argparse.Namespace) -> int:
            from benchmarks.common.results_file import write_page
            from benchmarks.common.sections import run_sections

            section = importlib.import_module(module).run
            return run_sections({name: section}, args, lambda page: write_page(args.output, page))

        return cls(name, measures, duration, configure, run)

    @property
    def folder(self) -> Path:
        """``benchmarks/<name>/``, the study's package."""
        return BENCHMARKS / self.name

    @property
    def results(self) -> Path:
        """``benchmarks/<name>/RESULTS.md``, the study's one results file."""
        return self.folder / "RESULTS.md"


def quiet_libraries() -> None:
    """Silence library warnings and progress logs, which would bury the benchmark's own progress lines."""
    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "torch._dynamo", "torch.export", "nncf", "onnxruntime", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)


def add_settings_options(parser: argparse.ArgumentParser, default_output: Path | None, *, work_dir: bool = True,
                         latency: bool = True) -> None:
    """``--quick``, ``--tiny``, ``--output`` and (when the study uses them) ``--work-dir`` and ``--no-latency``."""
    parser.add_argument("--quick", action="store_true", help="≤ 10 min on 2 cores: fewer rows, batches, repeats")
    parser.add_argument("--tiny", action="store_true", help="one tiny case per section (used by the smoke test)")
    where = default_output or "the study's RESULTS.md"
    parser.add_argument("--output", type=Path, default=default_output, help=f"markdown report (default: {where})")
    if work_dir:
        parser.add_argument("--work-dir", type=Path, default=None, help="keep ONNX files here (default: a temp dir)")
    if latency:
        parser.add_argument("--no-latency", action="store_true",
                            help="skip the onnxruntime latency measurements (e.g. on a shared machine)")
