"""Study ``corpus``: the real-architecture corpus (issue 13), ours vs onnxruntime ``quantize_static`` per model.

:mod:`benchmarks.corpus.models` lists the 40 ``transformers`` / ``timm`` architectures, :mod:`benchmarks.corpus.runner`
measures one of them and :mod:`benchmarks.corpus.section` builds the tables.
"""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]

STUDY = Study.one_section(
    name="corpus",
    measures="40 real transformers / timm architectures under w8a8: where the pipeline stops, verify_onnx, SQNR, "
             "integer kernels, latency and export time vs onnxruntime quantize_static",
    duration="not recorded for the 40 models; --quick runs 4 models, --tiny one",
    module="benchmarks.corpus.section",
)
