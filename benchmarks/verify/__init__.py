"""Study ``verify``: can ``verify_onnx`` be fooled on real architectures (issue 28)? Defects, clean files, cost."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="verify",
    measures="verify_onnx on the corpus: single defects written into w8a8 files of 12 models (each output-changing "
             "one must be flagged), every clean export (must be ok; decoder token agreement), and the cost of the "
             "per-quantizer comparison on the zoo",
    duration="mutations: about 25 min; clean: about 30 min for 40 models (w8a8); cost: about 5 min (10 rounds)",
    module="benchmarks.verify.study",
)
