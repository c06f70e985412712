"""Study ``sweep`` (issue 30): every ``transformers`` model type and one model per ``timm`` family, end to end."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="sweep",
    measures="prepare -> calibrate -> convert -> export -> verify on 389 architectures (291 transformers model types, "
             "98 timm families) beside quantize_static: stage reached, error class, SQNR ours / peer, integer kernels",
    duration="chunked and resumable (--chunk i/n); 15 models in 57 min niced at a load average of ~25 on 2 "
             "cores (93-421 s each; 17-47 s on a lighter load)",
    module="benchmarks.sweep.run",
    entry="main",
)
