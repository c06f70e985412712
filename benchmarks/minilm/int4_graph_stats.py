"""What an int4 ONNX file holds and what onnxruntime makes of it: bytes, op counts, MatMulNBits accuracy levels.

Two views of one file:

* ``file``: the nodes as written (``MatMulNBits``, ``GatherBlockQuantized``, ``DequantizeLinear``, ``MatMul``);
* ``kernel``: the graph onnxruntime runs after ``ORT_ENABLE_ALL`` (saved with ``optimized_model_filepath``), where
  ``DequantizeLinear(int4) -> MatMul`` pairs have been fused into ``MatMulNBits``.

A *float linear* is a ``MatMul`` / ``Gemm`` / ``FusedMatMul`` whose second operand is a float initializer (a
weight left unquantized); the attention products (both operands computed) are not counted.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import onnx
from onnx import TensorProto

__all__ = ["file_bytes", "graph_stats"]

_LINEAR_OPS = ("MatMul", "Gemm", "FusedMatMul")
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


def file_bytes(path: Path) -> int:
    """Size of the ONNX file plus its external-data file (``<name>.data``) when there is one."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _counts(model: onnx.ModelProto) -> dict[str, object]:
    graph = model.graph
    float_inits = {t.name for t in graph.initializer if t.data_type in _FLOAT_TYPES and len(t.dims) == 2}
    ops = Counter(n.op_type for n in graph.node)
    float_linears = [n.name for n in graph.node if n.op_type in _LINEAR_OPS and len(n.input) > 1
                     and n.input[1] in float_inits]
    levels = Counter(next((int(a.i) for a in n.attribute if a.name == "accuracy_level"), 0)
                     for n in graph.node if n.op_type == "MatMulNBits")
    gbq_bits = Counter(next((int(a.i) for a in n.attribute if a.name == "bits"), 4)
                       for n in graph.node if n.op_type == "GatherBlockQuantized")
    return {
        "MatMulNBits": ops.get("MatMulNBits", 0),
        "GatherBlockQuantized": ops.get("GatherBlockQuantized", 0),
        "DequantizeLinear": ops.get("DequantizeLinear", 0),
        "float_linears": len(float_linears),
        "float_linear_names": float_linears[:8],
        "accuracy_levels": {str(k): v for k, v in sorted(levels.items())},
        "gather_block_quantized_bits": {str(k): v for k, v in sorted(gbq_bits.items())},
        "ops": dict(sorted(ops.items())),
    }


def graph_stats(path: Path) -> dict[str, object]:
    """``{"file": counts, "kernel": counts}`` of ``path`` (module docstring); raises if onnxruntime cannot load it."""
    import onnxruntime as ort

    written = _counts(onnx.load(str(path), load_external_data=False))
    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(optimized)
        options.intra_op_num_threads = 1
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        kernel = _counts(onnx.load(str(optimized), load_external_data=False))
    return {"file": written, "kernel": kernel}
