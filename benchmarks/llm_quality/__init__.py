"""Study ``llm_quality``: held-out perplexity of a small LM trained here, ours vs onnxruntime-genai (issue 32)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="llm_quality",
    measures="held-out perplexity (>= 20k tokens, onnxruntime) of a Llama-style LM trained here on the standard "
             "library's text: fp32, our w8a8 / w4 per rounding / w4 int8 compute, onnxruntime-genai's builder int4",
    duration="training 6 min once (cached), then 25 min for the 13 rows (two at a time) on a loaded 2-core machine",
    module="benchmarks.llm_quality.study",
)
