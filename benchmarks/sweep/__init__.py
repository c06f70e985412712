"""Study ``sweep`` (issue 30): every ``transformers`` model type and one model per ``timm`` family, end to end."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="sweep",
    measures="prepare -> calibrate -> convert -> export -> verify on 389 architectures (291 transformers model types, "
             "98 timm families) beside quantize_static: stage reached, error class, SQNR ours / peer, integer kernels",
    duration="chunked and resumable (--chunk i/n); chunk 0/13 ran 21 of 30 models in 29.7 min on a loaded machine",
    module="benchmarks.sweep.run",
    entry="main",
)
