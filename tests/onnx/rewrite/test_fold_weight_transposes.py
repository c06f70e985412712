"""fold_weight_transposes: DequantizeLinear(W_q) -> Transpose becomes DequantizeLinear(W_qᵀ), bit-identical."""

from __future__ import annotations

import functools
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx import fusion_report
from coreai_opt.onnx.rewrite.rules.fold_weight_transposes import FoldWeightTransposes
from tests.onnx.onnx_graphs import run, save
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, rewrite_count

RNG = np.random.default_rng(7)
N, K = 16, 64
RULE = FoldWeightTransposes()

fold_weight_transposes = functools.partial(rewrite_count, rule=RULE)


def _linear_model(granularity: str) -> onnx.ModelProto:
    """``y = x @ Transpose(DequantizeLinear(W_q[N, K]))``, as the exporter writes a Linear on a 3-D input."""
    if granularity == "int4_blocked":
        weight = RNG.integers(-8, 8, (N, K)).astype(ml_dtypes.int4)
        scale = (RNG.random((N, K // 32)) * 0.1 + 0.01).astype(np.float32)
        attrs = {"axis": 1, "block_size": 32}
    elif granularity == "int8_per_channel":
        weight = RNG.integers(-128, 128, (N, K)).astype(np.int8)
        scale = (RNG.random(N) * 0.1 + 0.01).astype(np.float32)
        attrs = {"axis": 0}
    else:
        weight = RNG.integers(-128, 128, (N, K)).astype(np.int8)
        scale = np.asarray(np.float32(0.05))
        attrs = {}
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], **attrs),
        helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w_t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4, N])],
        [numpy_helper.from_array(weight, "w_q"), numpy_helper.from_array(scale, "w_scale")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("granularity", ["int4_blocked", "int8_per_channel", "int8_per_tensor"])
def test_fold_weight_transposes_drops_transpose_and_keeps_values(granularity: str) -> None:
    model = _linear_model(granularity)
    x = RNG.standard_normal((2, 4, K)).astype(np.float32)
    expected = run(model, {"x": x})[0]
    assert fold_weight_transposes(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    stored = {t.name: t for t in model.graph.initializer}
    assert list(stored["w_q"].dims) == [K, N]
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)
    assert_idempotent(model, RULE)


def test_fold_weight_transposes_lets_onnxruntime_use_matmulnbits(tmp_path: Path) -> None:
    before = fusion_report(save(_linear_model("int4_blocked"), tmp_path / "before.onnx"))
    model = _linear_model("int4_blocked")
    fold_weight_transposes(model)
    after = fusion_report(save(model, tmp_path / "after.onnx"))
    assert before.num_integer_compute == 0 and before.num_float_compute == 1
    assert after.integer_compute == {"MatMulNBits": 1} and after.num_float_compute == 0


def test_fold_weight_transposes_leaves_a_weight_whose_dequantized_value_has_other_readers() -> None:
    model = _linear_model("int8_per_channel")
    model.graph.node.append(helper.make_node("Identity", ["w"], ["w_copy"]))  # a second reader of the DQ output
    model.graph.output.append(helper.make_tensor_value_info("w_copy", TensorProto.FLOAT, [N, K]))
    before = model.SerializeToString()
    assert fold_weight_transposes(model) == 0
    assert model.SerializeToString() == before


def test_fold_weight_transposes_copies_a_shared_blocked_zero_point() -> None:
    model = _linear_model("int4_blocked")
    zero = numpy_helper.from_array(np.zeros((N, K // 32), ml_dtypes.int4), "shared_zp")
    model.graph.initializer.append(zero)
    model.graph.node[0].input.append("shared_zp")
    model.graph.node.append(helper.make_node("DequantizeLinear", ["w_q2", "w_scale2", "shared_zp"], ["other"],
                                             axis=1, block_size=32))
    model.graph.initializer.extend([
        numpy_helper.from_array(np.ones((N, K), ml_dtypes.int4), "w_q2"),
        numpy_helper.from_array(np.ones((N, K // 32), np.float32), "w_scale2"),
    ])
    model.graph.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, [N, K]))
    x = RNG.standard_normal((2, 4, K)).astype(np.float32)
    expected = run(model, {"x": x})
    assert fold_weight_transposes(model) == 1
    stored = {t.name: list(t.dims) for t in model.graph.initializer}
    assert stored["shared_zp"] == [N, K // 32] and stored["w_q_zero_point_t"] == [K // 32, N]
    for got, want in zip(run(model, {"x": x}), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_fold_weight_transposes_records_why_a_shared_stored_weight_stays() -> None:
    model = _linear_model("int8_per_channel")
    model.graph.node.append(helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_other"], axis=0))
    model.graph.output.append(helper.make_tensor_value_info("w_other", TensorProto.FLOAT, [N, K]))
    before = model.SerializeToString()
    reason = "the stored weight has other readers (it cannot be transposed for one of them)"
    assert apply_rule(model, RULE) == (0, [reason])
    assert model.SerializeToString() == before


def test_fold_weight_transposes_gives_every_weight_of_a_shared_blocked_scale_its_own_copy() -> None:
    """Two folded weights share one blocked scale (as identical encoder layers do): both get a transposed copy.

    Sharing is decided on the graph as exported: the second weight must not transpose the shared scale in place
    after the first one's copy left it with a single reader (that changed the exported bytes).
    """
    model = _linear_model("int4_blocked")
    model.graph.node.extend([
        helper.make_node("DequantizeLinear", ["w_q2", "w_scale"], ["w2"], axis=1, block_size=32),
        helper.make_node("Transpose", ["w2"], ["w2_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w2_t"], ["y2"]),
    ])
    model.graph.initializer.append(numpy_helper.from_array(RNG.integers(-8, 8, (N, K)).astype(ml_dtypes.int4),
                                                           "w_q2"))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["B", 4, N]))
    x = RNG.standard_normal((2, 4, K)).astype(np.float32)
    expected = run(model, {"x": x})
    assert fold_weight_transposes(model) == 2
    stored = {t.name: list(t.dims) for t in model.graph.initializer}
    assert "w_scale" not in stored  # the shared original is read by nobody now: the driver removed it
    assert stored["w_q_scale_t"] == stored["w_q2_scale_t"] == [K // 32, N]
    assert [list(n.input)[1] for n in model.graph.node if n.op_type == "DequantizeLinear"] == [
        "w_q_scale_t", "w_q2_scale_t"]
    for got, want in zip(run(model, {"x": x}), expected, strict=True):
        np.testing.assert_array_equal(got, want)
