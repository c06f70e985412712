"""What onnxruntime actually runs: integer kernels vs float Conv/MatMul left, read from its optimized graph.

Uses ``co.fusion_report`` (the project's own report) when it is importable, else counts the optimized graph here
the same way (dump with ``SessionOptions.optimized_model_filepath``, count op types).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx

from benchmarks.common.onnx_utils import session

INTEGER_COMPUTE = frozenset(
    {"QLinearConv", "NhwcQLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "MatMulNBits",
     "ConvInteger", "MatMulInteger", "DynamicQuantizeMatMul", "QAttention", "QLinearConvTranspose"}
)
FLOAT_COMPUTE = frozenset(
    {"Conv", "FusedConv", "ConvTranspose", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "NhwcFusedConv"}
)


@dataclass(frozen=True)
class FusionCounts:
    """Counts of onnxruntime's optimized graph, grouped by what they mean for speed."""

    integer_compute: dict[str, int]
    float_compute: dict[str, int]
    other_integer: dict[str, int]
    quantize_linear: int
    dequantize_linear: int
    source: str

    @staticmethod
    def _fmt(counts: dict[str, int]) -> str:
        return " + ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "–"

    @property
    def integer_summary(self) -> str:
        """E.g. ``20 QLinearConv + 1 QGemm``."""
        return self._fmt(self.integer_compute)

    @property
    def float_summary(self) -> str:
        """E.g. ``11 Conv``."""
        return self._fmt(self.float_compute)

    @property
    def other_summary(self) -> str:
        """E.g. ``8 QLinearAdd``."""
        return self._fmt(self.other_integer)


def _own_count(path: Path, work_dir: Path) -> FusionCounts:
    optimized = work_dir / (path.stem + ".ort-opt.onnx")
    session(path, threads=1, optimized_path=optimized)
    ops = Counter(node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node)
    other = {op: n for op, n in ops.items() if op not in INTEGER_COMPUTE and (op.startswith("QLinear")
                                                                              or op == "NhwcMaxPool")}
    return FusionCounts(
        {op: n for op, n in ops.items() if op in INTEGER_COMPUTE},
        {op: n for op, n in ops.items() if op in FLOAT_COMPUTE},
        other,
        ops.get("QuantizeLinear", 0) + ops.get("DynamicQuantizeLinear", 0),
        ops.get("DequantizeLinear", 0),
        "benchmarks.fusion",
    )


def count_fused(path: Path, work_dir: Path) -> FusionCounts:
    """Fusion counts of the ONNX model at ``path`` (``co.fusion_report`` if available)."""
    try:
        from coreai_opt.onnx import fusion_report
    except ImportError:
        return _own_count(path, work_dir)
    r = fusion_report(path)
    return FusionCounts(dict(r.integer_compute), dict(r.float_compute), dict(r.other_quantized), r.quantize_linear,
                        r.dequantize_linear, "co.fusion_report")
