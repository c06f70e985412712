"""Study ``export_cost`` (issue 29): ``export_onnx`` seconds over a float dynamo export with the same dynamic axes."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="export_cost",
    measures="export_onnx of the w8a8 model over torch's float dynamo export of the same model with the same dynamic "
             "axes (read from our file), rounds interleaved, per corpus model: median ratio and its spread",
    duration="about 20-60 s per model and round pair on the 2-core machine; resumable (--models, rows.jsonl)",
    module="benchmarks.export_cost.run",
    entry="main",
)
