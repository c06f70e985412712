"""benchmarks/int4_graph_stats.py counts what the issue-18 table reports: the file as written and as run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def _model(path: Path) -> Path:
    """``y = (x @ DQ(int4 W1)) @ W2_float``, plus an activation-by-activation MatMul (not a linear)."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1_q", TensorProto.INT4, (64, 16), rng.integers(-8, 8, size=64 * 16).tolist())
    scale = numpy_helper.from_array(np.full((2, 16), 0.01, np.float32), "w1_scale")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("DequantizeLinear", ["w1_q", "w1_scale"], ["w1"], axis=0, block_size=32),
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["y"]),
        helper.make_node("Transpose", ["y"], ["yt"], perm=[1, 0]),
        helper.make_node("MatMul", ["y", "yt"], ["gram"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("gram", TensorProto.FLOAT, [4, 4])],
                              initializer=[w1, scale, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_graph_stats_counts_the_int4_matmul_fused_by_onnxruntime_and_the_float_linear(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from benchmarks.minilm.int4_graph_stats import file_bytes, graph_stats

    path = _model(tmp_path / "m.onnx")
    stats = graph_stats(path)
    assert stats["file"]["DequantizeLinear"] == 1
    assert stats["file"]["MatMulNBits"] == 0
    assert stats["file"]["float_linears"] == 1  # h @ w2; the Gram product of two activations is not a linear
    assert stats["kernel"]["MatMulNBits"] == 1
    assert stats["kernel"]["DequantizeLinear"] == 0
    assert stats["kernel"]["accuracy_levels"] == {"4": 1}
    assert stats["kernel"]["float_linears"] == 1
    assert file_bytes(path) == path.stat().st_size
