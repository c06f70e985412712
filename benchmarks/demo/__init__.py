"""Study ``demo``: does the demo's table survive another CPU's float kernels (conv / linear outputs moved by ulps)?"""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="demo",
    measures="the coreai-opt demo under emulated CPU kernels: every conv / linear output moved by up to --ulps "
             "float32 ulps in calibration and eager; how many tables (latency aside) equal the unperturbed one",
    duration="about 20 s a run on a quiet machine (8 runs: under 3 min); prints to the console",
    module="benchmarks.demo.kernels",
    entry="main",
)
