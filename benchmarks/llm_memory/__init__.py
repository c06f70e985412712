"""Study ``llm_memory``: peak RSS and time per stage of a TinyLlama-wide w4 KV-cache decoder, CLI vs API (issue 32)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="llm_memory",
    measures="TinyLlama-wide random-init Llama (hidden 2048, 32 / 4 heads, vocab 32000) at several depths: "
             "`coreai-opt quantize --task text-generation --preset w4` and the same job through the Python API, "
             "each in a fresh child process: peak RSS and seconds per stage over the fp32 weights, with a "
             "least-squares fit peak = a + b * layers extrapolated to 22 layers (1.1 B)",
    duration="about 10-25 min per (depth, route) at 1-4 layers on the shared 2-core machine; needs ~6 GB free",
    module="benchmarks.llm_memory.decoder_memory",
)
