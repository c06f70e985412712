"""Study ``auto``: ``co.auto_quantize`` with defaults on MiniLM, a transformer encoder and the CNNs (issue 19)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]

STUDY = Study.one_section(
    name="auto",
    measures="co.auto_quantize next to the presets and onnxruntime quantize_dynamic: onnxruntime accuracy, "
             "timed latency (unless --no-latency) and the cost model's estimate",
    duration="3.2 min (recorded run, quiet machine)",
    module="benchmarks.auto.section",
)
