"""Study ``memory``: peak resident memory of each pipeline stage on large models (issue 20)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="memory",
    measures="peak RSS of prepare / calibrate / convert / export / verify as multiples of the fp32 weights, each "
             "(model, preset) in a fresh process, against a plain float dynamo export",
    duration="2.4 GB row: about 3.5 min of stages per preset + 25 s float export (needs ~5 GB free); "
             "the 1.1 B decoder needs ~10 GB",
    module="benchmarks.memory.pipeline_memory",
)
