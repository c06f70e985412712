"""guard_4bit_activations on a hand-built ``Q -> DQ -> Conv -> Q -> DQ -> MaxPool`` graph with uint4 activations."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph

from coreai_opt.onnx.rewrite.rules.guard_4bit_activations import GuardFourBitActivations
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, rewrite_count

RULE = GuardFourBitActivations()


def guard_4bit_activations(model: onnx.ModelProto) -> int:
    return rewrite_count(model, RULE)


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        helper.make_tensor("zp", TensorProto.UINT4, [], [8]),
        helper.make_tensor("w_q", TensorProto.INT8, [2, 1, 3, 3], rng.integers(-8, 8, 18).tolist()),
        numpy_helper.from_array(np.array(0.05, np.float32), "w_s"),
        helper.make_tensor("w_zp", TensorProto.INT8, [], [0]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"], name="dq_w"),
        helper.make_node("Conv", ["xd", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["y", "s", "zp"], ["yq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["yq", "s", "zp"], ["yd"], name="dq_out"),
        helper.make_node("MaxPool", ["yd"], ["out"], name="pool", kernel_shape=[2, 2]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2, 3, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(model: onnx.ModelProto, x: np.ndarray, level: ort.GraphOptimizationLevel) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_guards_go_after_activation_dequantizers_and_before_the_computed_quantizer_only() -> None:
    model = _model()
    assert guard_4bit_activations(model) == 3
    onnx.checker.check_model(model)
    ops = [(n.op_type, list(n.input)) for n in model.graph.node]
    assert [op for op, _ in ops] == ["QuantizeLinear", "DequantizeLinear", "Max", "DequantizeLinear", "Conv", "Max",
                                     "QuantizeLinear", "DequantizeLinear", "Max", "MaxPool"]
    assert ops[3][1][0] == "w_q"  # the weight dequantizer feeds the conv directly (MatMulNBits-style fusions stay)
    assert guard_4bit_activations(_model_without_four_bit()) == 0


def _model_without_four_bit() -> onnx.ModelProto:
    model = _model()
    for init in model.graph.initializer:
        if init.name == "zp":
            init.CopyFrom(helper.make_tensor("zp", TensorProto.UINT8, [], [8]))
    return model


def test_onnxruntime_runs_the_guarded_file_optimized_and_bit_identical_to_unoptimized() -> None:
    x = np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float32)
    plain = _model()
    guarded = _model()
    guard_4bit_activations(guarded)
    reference = _run(plain, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    with pytest.raises(InvalidGraph, match=r"tensor\(uint4\).*QLinearConv"):  # why the guards exist
        _run(plain, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert np.array_equal(_run(guarded, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL), reference)
    assert np.array_equal(_run(guarded, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), reference)


def test_guards_are_applied_once_and_share_one_bound() -> None:
    model = _model()
    guard_4bit_activations(model)
    bounds = [t.name for t in model.graph.initializer if t.name.startswith("four_bit_guard_lowest")]
    assert bounds == ["four_bit_guard_lowest"]
    assert {n.input[1] for n in model.graph.node if n.op_type == "Max"} == {"four_bit_guard_lowest"}
    assert_idempotent(model, RULE)


def test_a_quantizer_of_a_graph_input_is_a_recorded_near_miss() -> None:
    """``q_in`` reads the graph input ``x``: nothing in front of it can fuse, so it gets no guard, and says why."""
    model = _model()
    count, reasons = apply_rule(model, RULE)
    assert count == 3
    assert reasons == ["reads a graph input: no op in front of it to keep from fusing"]
