"""Study ``audit`` (issue 29): the graph onnxruntime runs for ours vs ``quantize_static``, per model, and the speed gap.

:mod:`benchmarks.audit.models` adds architectures outside the corpus, :mod:`benchmarks.audit.census` reads one
optimized graph, :mod:`benchmarks.audit.run` measures models (resumably, one row per model in ``rows.jsonl``) and
writes the table.
"""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="audit",
    measures="placement audit vs onnxruntime quantize_static on the 40 corpus models and 12 others: integer kernels, "
             "Q/DQ left, float ops between integer kernels (by op type) in the optimized graph (ORT_ENABLE_ALL, "
             "1 thread), latency ratio (interleaved, batch 1), SQNR ours / peer",
    duration="about 40 s per model on the 2-core machine; resumable (--models, rows.jsonl)",
    module="benchmarks.audit.run",
    entry="main",
)
