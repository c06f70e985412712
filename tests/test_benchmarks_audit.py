"""The placement audit's graph census and latency spread (benchmarks/audit), on hand-built graphs."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from benchmarks.audit.census import census
from benchmarks.audit.run import _per_round_ratios


def _graph(nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]))


def test_census_counts_float_ops_only_between_a_dequantize_and_a_quantize() -> None:
    model = _graph([
        helper.make_node("Relu", ["x"], ["x1"]),  # before the first quantizer: not between
        helper.make_node("QuantizeLinear", ["x1", "s", "z"], ["q0"]),
        helper.make_node("QLinearMatMul", ["q0", "s", "z", "w", "s", "z", "s", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"]),
        helper.make_node("Softmax", ["d1"], ["a"]),  # between
        helper.make_node("Shape", ["a"], ["shape"]),  # reads no values: not counted, ends the path
        helper.make_node("Reshape", ["a", "shape"], ["b"]),  # between
        helper.make_node("QuantizeLinear", ["b", "s", "z"], ["q2"]),
        helper.make_node("QLinearAdd", ["q2", "s", "z", "q1", "s", "z", "s", "z"], ["q3"]),
        helper.make_node("DequantizeLinear", ["q3", "s", "z"], ["d3"]),
        helper.make_node("Tanh", ["d3"], ["y"]),  # after the last quantizer: not between
        helper.make_node("ReorderInput", ["d3"], ["r"]),  # a layout conversion, counted apart
        helper.make_node("ReorderOutput", ["r"], ["unused"]),
    ])
    result = census(model)
    assert result.float_between == {"Softmax": 1, "Reshape": 1}
    assert (result.integer_compute, result.other_integer, result.quantize, result.dequantize, result.layout) == (
        1, 1, 2, 2, 2)


def test_census_treats_a_float_output_integer_kernel_as_leaving_the_integer_domain() -> None:
    model = _graph([
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
        helper.make_node("MatMulIntegerToFloat", ["q", "w", "s", "ws", "z", "wz"], ["f"]),
        helper.make_node("Gelu", ["f"], ["g"], domain="com.microsoft"),  # between two dynamic matmuls
        helper.make_node("DynamicQuantizeLinear", ["g"], ["q2", "s2", "z2"]),
        helper.make_node("MatMulIntegerToFloat", ["q2", "w", "s2", "ws", "z2", "wz"], ["y"]),
    ])
    assert census(model).float_between == {"Gelu": 1}


def test_per_round_ratio_is_the_ratio_of_each_rounds_fastest_runs() -> None:
    ours = (2.0, 4.0, 3.0, 1.0, 1.5, 1.0)  # rounds of 3 runs: fastest 2, 1
    peer = (1.0, 2.0, 3.0, 4.0, 2.0, 9.0)  # fastest 1, 2 (a run disturbed by load, 9.0, changes nothing)
    assert _per_round_ratios(ours, peer, 3) == [2.0, 0.5]


def test_input_dependence_is_zero_for_a_constant_output_and_one_for_independent_noise() -> None:
    import numpy as np

    from benchmarks.corpus.runner import input_dependence

    constant = [np.tile(np.arange(10.0), (8, 1)) for _ in range(3)]
    assert input_dependence(constant) == 0.0
    noise = [np.random.default_rng(seed).standard_normal((64, 10)) for seed in range(4)]
    assert 0.95 < input_dependence(noise) < 1.0  # ~1 - 1/256 for N(0, 1) at every position


def test_a_degenerate_row_says_its_batchnorm_statistics_came_from_data() -> None:
    from benchmarks.audit.run import _flags

    assert _flags({"input_dependence": [2e-5, 0.96]}) == ["BN from data (input dependence 2e-05 → 0.96)"]
    assert _flags({"input_dependence": [2e-5, 3e-4]}) == [
        "BN from data (input dependence 2e-05 → 0.00)", "degenerate output (input dependence 3e-04)"]
    assert _flags({"input_dependence": [0.5]}) == []
