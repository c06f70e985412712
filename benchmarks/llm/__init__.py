"""Study ``llm``: 8 decoder families x w4 / w8 / w8a8_dynamic as KV-cache decoder files, token-identical generation."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="llm",
    measures="Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma2, GPT-2, GPT-NeoX (tiny random) x w4 / w8 / w8a8_dynamic "
             "with --task text-generation: greedy tokens eager vs onnxruntime and cache vs no cache, flips and "
             "their near-tie margins, file size, time (issue 32)",
    duration="about 45 min on the shared, loaded 2-core machine (24 cells, 30-150 s each + the CLI cell); --quick: "
             "w8a8_dynamic only; --tiny: one cell (about 1.5 min)",
    module="benchmarks.llm.matrix",
)
