"""Run sections that share :class:`~benchmarks.common.settings.Settings` and write them as one results page.

The studies ``comparison``, ``corpus``, ``auto`` and ``minilm w8a8`` take the same options (``--quick``,
``--tiny``, ``--work-dir``, ``--no-latency``, ``--output``; :func:`benchmarks.common.study.add_settings_options` adds
them), and :func:`run_sections` runs the chosen sections one after another, rewriting the page
(:mod:`benchmarks.common.results_page`) after each one, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from benchmarks.common import results_page
from benchmarks.common.results import SectionResult, attempt
from benchmarks.common.settings import Settings
from benchmarks.common.study import quiet_libraries
from benchmarks.common.torchvision_ops import declare_torchvision_ops

__all__ = ["Section", "run_sections"]

Section = Callable[[Settings], SectionResult]


def run_sections(sections: Mapping[str, Section], args: argparse.Namespace, write: Callable[[str], None]) -> int:
    """Run ``sections`` in order with the settings of ``args``; ``write(page)`` after each section and at the end."""
    quiet_libraries()
    declare_torchvision_ops()  # before anything imports transformers / timm (see benchmarks/common/torchvision_ops.py)
    started, t0 = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="coreai_bench_") as tmp:
        work_dir = getattr(args, "work_dir", None) or Path(tmp)
        settings = Settings(quick=args.quick or args.tiny, tiny=args.tiny, work_dir=work_dir,
                            torch_threads=1 if args.tiny else 2, latency=not getattr(args, "no_latency", False))
        torch.set_num_threads(settings.torch_threads)
        results: list[SectionResult] = []
        for key, section_fn in sections.items():
            print(f"[benchmarks] {key} ...", flush=True)
            start = time.perf_counter()
            out = attempt(lambda section_fn=section_fn: section_fn(settings))
            section = out.value if out.ok else SectionResult(key, key, errors=[f"section failed: {out.error}"])
            section.seconds = time.perf_counter() - start
            results.append(section)
            print(f"[benchmarks] {key} done in {section.seconds:.0f} s", flush=True)
            write(results_page.render(results, args.command, started, time.perf_counter() - t0))
    write(results_page.render(results, args.command, started, time.perf_counter() - t0))
    print(f"[benchmarks] done ({(time.perf_counter() - t0) / 60:.1f} min)")
    return 0
