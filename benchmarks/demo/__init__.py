"""Study ``demo``: does the demo's table survive another CPU's float kernels (conv / linear outputs moved by ulps)?"""

from __future__ import annotations

import argparse

from benchmarks.common.study import Study

__all__ = ["STUDY"]


def _configure(parser: argparse.ArgumentParser) -> None:
    from benchmarks.demo import kernels

    kernels.configure(parser)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.demo import kernels

    return kernels.main(args)


STUDY = Study(
    name="demo",
    measures="the coreai-opt demo under emulated CPU kernels: every conv / linear output moved by up to --ulps "
             "float32 ulps in calibration and eager; how many tables (latency aside) equal the unperturbed one",
    duration="about 20 s a run on a quiet machine (8 runs: under 3 min); prints to the console",
    configure=_configure,
    run=_run,
)
