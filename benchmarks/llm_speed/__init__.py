"""Study ``llm_speed``: our w4 KV-cache decoder vs onnxruntime-genai's builder int4, prefill and decode (issue 32)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="llm_speed",
    measures="20 M Llama-style decoder, batch 1, prompt 64 + 64 greedy tokens, 1 thread: prefill time and decode "
             "tok/s of our w4 KV-cache file (compute float / int8) over onnxruntime-genai's builder int4, "
             "interleaved rounds in one process; per-op decode-step profile",
    duration="about 3 min for the files plus about 1 s per round (shared 2-core machine)",
    module="benchmarks.llm_speed.decode_speed",
)
