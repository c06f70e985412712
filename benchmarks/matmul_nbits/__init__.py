"""Study ``matmul_nbits``: weight-only linears, float- vs int8-compute ``MatMulNBits`` on a decoder (issue 15)."""

from __future__ import annotations

from benchmarks.common.study import Study

__all__ = ["STUDY"]


STUDY = Study.from_module(
    name="matmul_nbits",
    measures="w8 / w4 weight-only decoder at compute float vs int8: MatMulNBits accuracy levels, error vs eager, "
             "top-1 agreement, latency / fp32 at batch 1 and 8 (onnxruntime, 1 thread)",
    duration="not recorded; run on a quiet machine (the ratios are the speed claim); --quick is a smoke run",
    module="benchmarks.matmul_nbits.compute_modes",
)
