"""guard_quantized_sums: ``Max(x, lowest)`` before a ReduceSum of an asymmetric 8/4-bit DequantizeLinear; onnxruntime
bit-identical (minimal graph with out-of-range and infinite inputs, and zoo exports), nothing else matched."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import coreai_opt
from coreai_opt.onnx import export_onnx, rewrite
from coreai_opt.onnx.rewrite.rules.guard_quantized_sums import GuardQuantizedSums
from tests.onnx.openvino_graphs import reshaped_sum
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops
from tests.zoo import ZOO, build, preset_config

RULE = GuardQuantizedSums()


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _sum_of_dq(dtype: int, zero_point: float) -> onnx.ModelProto:
    """``x -> Q -> DQ(dtype, zero_point) -> ReduceSum(axes=[1])``."""
    zp = helper.make_tensor("z", dtype, [], [zero_point])
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), zp,
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("ReduceSum", ["d", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "sum", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_reshaped_sum_gets_one_guard_and_identical_onnxruntime_output_even_for_infinite_inputs() -> None:
    x = (np.random.default_rng(0).standard_normal((128, 16)) * 0.5).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 3e38, -3e38]  # saturate in QuantizeLinear; the DequantizeLinear output is finite
    plain = reshaped_sum()
    guarded = copy(plain)
    assert apply_rule(guarded, RULE) == (1, [])
    assert ops(guarded) == ops(reshaped_sum(guard=True))
    onnx.checker.check_model(guarded)
    assert np.array_equal(_run(guarded, {"x": x})[0], _run(plain, {"x": x})[0])
    assert_idempotent(guarded, RULE)


@pytest.mark.parametrize(("dtype", "zero_point", "expected"), [
    (TensorProto.UINT8, 128, 1), (TensorProto.INT8, -3, 1), (TensorProto.UINT4, 8, 1),
    (TensorProto.UINT8, 0, 0), (TensorProto.INT8, 0, 0),  # symmetric: nothing to misplace
    (TensorProto.UINT16, 30000, 0),  # OpenVINO strips 16-bit pairs (clip_16bit_activations)
    (TensorProto.FLOAT8E4M3FN, 0.0, 0),
])
def test_only_8_and_4_bit_integer_dequantizers_with_a_nonzero_zero_point_are_guarded(dtype: int, zero_point: float,
                                                                                    expected: int) -> None:
    model = _sum_of_dq(dtype, zero_point)
    x = (np.random.default_rng(1).standard_normal((4, 8)) * 3).astype(np.float32)
    before = _run(model, {"x": x})[0]
    assert apply_rule(model, RULE) == (expected, [])
    assert np.array_equal(_run(model, {"x": x})[0], before)


def test_a_sum_of_a_float_tensor_or_of_a_stored_weight_is_left_alone() -> None:
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axes"),
             numpy_helper.from_array(np.arange(32, dtype=np.uint8).reshape(4, 8), "w"),
             numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             numpy_helper.from_array(np.array(3, np.uint8), "z")]
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["a"], keepdims=0),
             helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"]),
             helper.make_node("ReduceSum", ["wd", "axes"], ["b"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [])
    assert model.SerializeToString() == before


def _export(name: str, preset: str, path: Path, rules: tuple[rewrite.Rule, ...]) -> tuple[onnx.ModelProto, list]:
    model, example, batches = build(name)
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("ignore")
        config = preset_config(preset, model)
        if name == "transformer_encoder":  # its mean pooling reads the final norm, float by default (no integer
            # kernel): an op_kind entry quantizes the norm's output, so the mean reads a DequantizeLinear
            config = config.set_op_kind("layer_norm", {"activation": config.activation})
        if name == "shape_unpack":  # its mean reads the mix linear, whose output only float ops read, so it stays
            # float by default (graph/unread_outputs.py): an op_kind entry quantizes it, so the mean reads a DQ
            config = config.set_op_kind("linear", {"activation": config.activation})
        prepared = coreai_opt.prepare(model, config, example)
        coreai_opt.calibrate(prepared, batches, progress=False)
        patch.setattr(rewrite, "POST_PASSES", rules)
        export_onnx(coreai_opt.convert(prepared), example, path)
    torch.manual_seed(123)
    return onnx.load(str(path)), [ZOO[name].make_input(16).numpy() for _ in range(4)]


@pytest.mark.parametrize(("name", "preset"), [
    ("shape_unpack", "w4a8"),
    pytest.param("transformer_encoder", "w4a8", marks=pytest.mark.slow),
    pytest.param("transformer_encoder", "w8a8", marks=pytest.mark.slow),
])
def test_zoo_mean_poolings_get_one_guard_each_and_bit_identical_onnxruntime_outputs(name: str, preset: str,
                                                                                   tmp_path: Path) -> None:
    without = tuple(rule for rule in rewrite.POST_PASSES if rule.name != RULE.name)
    exported, inputs = _export(name, preset, tmp_path / "exported.onnx", rewrite.POST_PASSES)
    unguarded, _ = _export(name, preset, tmp_path / "unguarded.onnx", without)
    assert rewrite.read_report(exported).counts[RULE.name] == 1  # the one mean pooling (zero point != 0)
    assert sum(n.op_type == "Max" for n in exported.graph.node) == sum(
        n.op_type == "Max" for n in unguarded.graph.node) + 1
    input_name = exported.graph.input[0].name
    for x in inputs:
        assert np.array_equal(_run(exported, {input_name: x})[0], _run(unguarded, {input_name: x})[0])
