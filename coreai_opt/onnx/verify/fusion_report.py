"""Which convolutions and matrix products onnxruntime runs as integer kernels, read from its optimized graph.

onnxruntime rewrites ``DequantizeLinear -> Conv/MatMul/Gemm -> QuantizeLinear`` groups into integer kernels
(``QLinearConv``, ``QLinearMatMul``, ``QGemm``, ``MatMulIntegerToFloat``, ``MatMulNBits``, ...) when the pattern
allows it and leaves the rest in float between a ``DequantizeLinear`` and a ``QuantizeLinear``. The only faithful
way to see what happened is to let onnxruntime optimize the model and dump the result
(``SessionOptions.optimized_model_filepath``); :func:`fusion_report` does that at ``ORT_ENABLE_EXTENDED`` (the
level that holds the QDQ fusions and writes a portable graph; ``ORT_ENABLE_ALL`` only adds hardware-specific
layout rewrites on top) and counts the node types. For a file written by ``export_onnx`` it also gives what the
export's own rewrite rules did and the near misses they recorded (:mod:`coreai_opt.onnx.rewrite.rewrite_report`), so the
report says both what onnxruntime fused and why a layer was left as it was ("linears_to_gemm skipped
node_MatMul_3 (q_proj/linear): weight is per-block").
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from coreai_opt.error_boundary import public_api
from coreai_opt.onnx.rewrite.rewrite_report import RewriteReport, read_report

__all__ = ["FusionReport", "fusion_report", "optimized_model", "INTEGER_COMPUTE_OPS", "FLOAT_COMPUTE_OPS"]

#: Node types (any domain) that run a convolution or matrix product on integer data.
INTEGER_COMPUTE_OPS: frozenset[str] = frozenset(
    {
        "QLinearConv",
        "NhwcQLinearConv",
        "QLinearMatMul",
        "QGemm",
        "MatMulIntegerToFloat",
        "MatMulNBits",
        "ConvInteger",
        "MatMulInteger",
        "DynamicQuantizeMatMul",
        "QAttention",
        "QLinearConvTranspose",
    }
)

#: Node types (any domain) that run a convolution or matrix product in floating point.
FLOAT_COMPUTE_OPS: frozenset[str] = frozenset(
    {"Conv", "FusedConv", "ConvTranspose", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "NhwcFusedConv"}
)

#: Initializers of onnxruntime's optimized dump at least this large stay in its external data, unread (the weights;
#: scales and zero points, which the tolerance rules read, are far smaller).
DUMP_EXTERNAL_MIN_BYTES = 1 << 20

# Integer kernels whose names do not start with "QLinear" (besides the conv / matmul ones above).
_OTHER_INTEGER_OPS = frozenset({"NhwcMaxPool", "QEmbedLayerNormalization", "QOrderedMatMul"})


@dataclass(frozen=True)
class FusionReport:
    """Op counts of onnxruntime's optimized graph, grouped by what they mean for speed.

    Attributes:
        integer_compute: Integer conv / matmul kernels, by op type (e.g. ``{"QLinearConv": 20}``).
        float_compute: Conv / matmul nodes still running in float, by op type.
        float_compute_nodes: Names of those float nodes (as onnxruntime names them), in graph order.
        other_quantized: Other integer kernels (``QLinearAdd``, ``QLinearMul``, ``QLinearConcat``, ...), by op type.
        quantize_linear: ``QuantizeLinear`` nodes left (each is a float -> int round trip at runtime).
        dequantize_linear: ``DequantizeLinear`` nodes left.
        op_counts: Every op type in the optimized graph.
        rewrites: The export's rewrite report stored in the file (None for files ``export_onnx`` did not write).
    """

    integer_compute: dict[str, int]
    float_compute: dict[str, int]
    float_compute_nodes: tuple[str, ...]
    other_quantized: dict[str, int]
    quantize_linear: int
    dequantize_linear: int
    op_counts: dict[str, int] = field(repr=False)
    rewrites: RewriteReport | None = None

    @property
    def num_integer_compute(self) -> int:
        """Number of conv / matmul nodes that run as integer kernels."""
        return sum(self.integer_compute.values())

    @property
    def num_float_compute(self) -> int:
        """Number of conv / matmul nodes that run in float."""
        return sum(self.float_compute.values())

    @property
    def all_compute_integer(self) -> bool:
        """True when at least one conv / matmul exists and none runs in float."""
        return self.num_float_compute == 0 and self.num_integer_compute > 0

    def __str__(self) -> str:
        rows = [("integer conv/matmul", self.num_integer_compute, _format_counts(self.integer_compute))]
        rows.append(("float conv/matmul", self.num_float_compute, _format_counts(self.float_compute)))
        rows.append(("other integer ops", sum(self.other_quantized.values()), _format_counts(self.other_quantized)))
        rows.append(("QuantizeLinear left", self.quantize_linear, ""))
        rows.append(("DequantizeLinear left", self.dequantize_linear, ""))
        width = max(len(r[0]) for r in rows)
        lines = ["onnxruntime fusion report"]
        lines += [f"  {label:<{width}}  {count:>5}  {detail}".rstrip() for label, count, detail in rows]
        if self.float_compute_nodes:
            lines.append("  float conv/matmul nodes: " + ", ".join(self.float_compute_nodes))
        if self.rewrites is not None:
            lines += ["", str(self.rewrites)]
        return "\n".join(lines)


def _format_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


def optimized_model(path: str | Path, level: str = "extended") -> onnx.ModelProto:
    """The graph onnxruntime's CPU provider runs for the model at ``path``, read back from its optimized dump.

    Args:
        path: An ONNX file.
        level: ``"extended"`` (the QDQ fusions; a portable graph) or ``"all"`` (onnxruntime's default session
            level: adds layout rewrites such as NCHWc; what ``verify_onnx``'s session runs).

    Returns:
        The optimized model, its initializers of at least :data:`DUMP_EXTERNAL_MIN_BYTES` (the weights) left in
        the dump's external data and not loaded: the graph and its scales cost little memory whatever the model.
    """
    import onnxruntime as ort

    optimization = ort.GraphOptimizationLevel
    levels = {"extended": optimization.ORT_ENABLE_EXTENDED, "all": optimization.ORT_ENABLE_ALL}
    if level not in levels:
        raise ValueError(f"level must be one of {sorted(levels)}, got {level!r}")
    with tempfile.TemporaryDirectory(prefix="coreai_opt_fusion_") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.optimized_model_filepath = str(optimized)
        options.log_severity_level = 3
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         "optimized.onnx.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         str(DUMP_EXTERNAL_MIN_BYTES))
        options.add_session_config_entry("session.disable_prepacking", "1")  # a dump only: no second weight layout
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return onnx.load(str(optimized), load_external_data=False)


@public_api
def fusion_report(path: str | Path) -> FusionReport:
    """Let onnxruntime (CPU provider) optimize the model at ``path`` and count what became integer kernels.

    Args:
        path: An ONNX file (external data next to it is fine).

    Returns:
        The :class:`FusionReport`; ``str(report)`` is a table (followed by the export's rewrite report).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file's ``coreai_opt.rewrites`` metadata entry is not a rewrite report.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"fusion_report: no ONNX file at {path}; pass the path export_onnx returned")
    graph = optimized_model(path).graph
    counts = Counter(node.op_type for node in graph.node)
    float_nodes = tuple(node.name or node.output[0] for node in graph.node if node.op_type in FLOAT_COMPUTE_OPS)
    del graph  # before the file itself is read for its rewrite report
    integer = {op: n for op, n in counts.items() if op in INTEGER_COMPUTE_OPS}
    floating = {op: n for op, n in counts.items() if op in FLOAT_COMPUTE_OPS}
    other = {
        op: n
        for op, n in counts.items()
        if op not in INTEGER_COMPUTE_OPS and (op.startswith("QLinear") or op in _OTHER_INTEGER_OPS)
    }
    return FusionReport(
        integer_compute=integer,
        float_compute=floating,
        float_compute_nodes=float_nodes,
        other_quantized=other,
        quantize_linear=counts.get("QuantizeLinear", 0),
        dequantize_linear=counts.get("DequantizeLinear", 0),
        op_counts=dict(counts),
        rewrites=read_report(onnx.load(str(path), load_external_data=False)),
    )
