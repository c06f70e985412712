"""fold_quantized_weights: constant weight / bias chains become quantized initializers, bit-exact with onnxruntime."""

from __future__ import annotations

import copy
import functools

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from coreai_opt.onnx.rewrite.rules.fold_quantized_weights import FoldQuantizedWeights
from tests.onnx.onnx_graphs import conv_qdq_model, run, weight_qdq_model
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, rewrite_count

RNG = np.random.default_rng(0)
RULE = FoldQuantizedWeights()

fold_quantized_weights = functools.partial(rewrite_count, rule=RULE)
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")

# (zero-point numpy dtype, ONNX type, scale divisor) per quantized type.
CASES = {
    "int8": (np.int8, TensorProto.INT8, 127),
    "uint8": (np.uint8, TensorProto.UINT8, 255),
    "int16": (np.int16, TensorProto.INT16, 32767),
    "uint16": (np.uint16, TensorProto.UINT16, 65535),
    "int4": (ml_dtypes.int4, TensorProto.INT4, 7),
    "uint4": (ml_dtypes.uint4, TensorProto.UINT4, 15),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN, 448),
    "float8_e5m2": (ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2, 57344),
}


def _weight_with_ties(shape: tuple[int, ...]) -> np.ndarray:
    w = RNG.standard_normal(shape).astype(np.float32)
    w.flat[:8] = [0.5, -0.5, 1.5, -2.5, 1e9, -1e9, 0.0, 3.5]  # ties and saturation
    return w


def _qparams(dtype: str, granularity: str, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    np_dtype, _, divisor = CASES[dtype]
    unsigned = dtype.startswith("u")
    if granularity == "per_tensor":
        scale, axis, block = np.float32(0.1 if dtype != "float8_e5m2" else 1e-3), 0, 0
        scale = np.asarray(scale, np.float32)
    elif granularity == "per_axis":
        scale, axis, block = (np.abs(weight[:, 8:]).max(1) / divisor * 2).astype(np.float32), 0, 0
    else:
        block = 8
        scale = (np.abs(weight[:, 8:]).reshape(weight.shape[0], -1, block).max(2) / divisor).astype(np.float32)
        scale = np.repeat(scale[:, :1], weight.shape[1] // block, axis=1) * np.float32(1.5)
        axis = 1
    zp_value = (divisor // 2) if unsigned else 0
    zero_point = np.full(scale.shape, zp_value).astype(np_dtype)
    return scale.astype(np.float32), zero_point, axis, block


@pytest.mark.parametrize("granularity", ["per_tensor", "per_axis", "per_block"])
@pytest.mark.parametrize("dtype", list(CASES))
def test_fold_quantized_weights_is_bit_exact_with_onnxruntime_quantize_linear(dtype: str, granularity: str) -> None:
    weight = _weight_with_ties((6, 32))
    scale, zero_point, axis, block = _qparams(dtype, granularity, weight)
    model = weight_qdq_model(weight, scale, zero_point, axis, block)
    x = RNG.standard_normal(weight.shape).astype(np.float32)
    expected = run(model, {"x": x})[0]

    folded = copy.deepcopy(model)
    assert fold_quantized_weights(folded) == 1
    onnx.checker.check_model(folded, full_check=True)

    assert [n.op_type for n in folded.graph.node] == ["DequantizeLinear", "Add"]
    stored = {t.name: t for t in folded.graph.initializer}
    assert "W" not in stored  # the float weight is gone
    zero_is_zero = not np.any(zero_point.astype(np.float64))
    dropped = zero_is_zero and dtype not in FLOAT8 and granularity == "per_block"
    assert len(folded.graph.node[0].input) == (2 if dropped else 3)
    assert stored["W_quantized"].data_type == CASES[dtype][1]
    np.testing.assert_array_equal(run(folded, {"x": x})[0], expected)
    assert_idempotent(folded, RULE)


def test_fold_quantized_weights_packs_int4_two_values_per_byte() -> None:
    weight = _weight_with_ties((16, 64))
    scale, zero_point, axis, block = _qparams("int4", "per_axis", weight)
    model = weight_qdq_model(weight, scale, zero_point, axis, block)
    fold_quantized_weights(model)
    stored = {t.name: t for t in model.graph.initializer}["W_quantized"]
    assert len(stored.raw_data) == 16 * 64 // 2
    q = numpy_helper.to_array(stored).astype(np.int32)
    expected = np.clip(np.rint(weight / scale[:, None]), -8, 7)
    np.testing.assert_array_equal(q, expected)


def test_fold_quantized_weights_folds_int32_bias_and_its_derived_scale() -> None:
    model = conv_qdq_model()
    x = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32) * 2
    expected = run(model, {"x": x})[0]

    assert fold_quantized_weights(model) == 2  # the DequantizeLinear of the conv weight and of the bias
    stored = {t.name: t for t in model.graph.initializer}
    assert stored["conv.bias_quantized"].data_type == TensorProto.INT32
    bias_scale = numpy_helper.to_array(stored["conv.bias_quantized_scale"])
    x_scale = numpy_helper.to_array(stored["x_scale"])
    w_scale = numpy_helper.to_array(stored["w_scale"])
    np.testing.assert_array_equal(bias_scale, x_scale * w_scale)
    assert {"Mul", "Div", "Round", "Cast"}.isdisjoint(n.op_type for n in model.graph.node)
    assert "conv.bias" not in stored and "conv.weight" not in stored
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)
    assert_idempotent(model, RULE)


def test_fold_quantized_weights_returns_zero_and_keeps_graph_when_nothing_is_constant() -> None:
    model = conv_qdq_model(float_weight_q=False)
    fold_quantized_weights(model)  # folds the bias chain only
    before = model.SerializeToString()
    assert fold_quantized_weights(model) == 0
    assert model.SerializeToString() == before


def test_fold_quantized_weights_leaves_activation_quantizers_alone() -> None:
    model = conv_qdq_model()
    fold_quantized_weights(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 2  # input and output activations
    assert ops.count("DequantizeLinear") == 4  # input, weight, bias, output


def test_fold_quantized_weights_saturates_float8_like_onnxruntime() -> None:
    weight = np.array([[1e6, -1e6, 450.0, 464.0, 470.0, -480.0, 0.3, 17.0]], np.float32)
    scale, zero_point = np.asarray(np.float32(1.0)), np.asarray(ml_dtypes.float8_e4m3fn(0))
    model = weight_qdq_model(weight, scale, zero_point)
    expected = run(model, {"x": np.zeros_like(weight)})[0]
    fold_quantized_weights(model)
    got = run(model, {"x": np.zeros_like(weight)})[0]
    np.testing.assert_array_equal(got, expected)
    assert got[0, :6].tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("per_channel", [False, True])
def test_fold_quantized_weights_moves_narrow_range_clamp_into_stored_integers(per_channel: bool) -> None:
    weight = _weight_with_ties((4, 16))
    scale = (np.abs(weight).max(1) / 127.5).astype(np.float32) if per_channel else np.asarray(np.float32(0.01))
    model = weight_qdq_model(weight, scale, np.zeros(scale.shape, np.int8), axis=0)
    low, high = (-127 * scale).astype(np.float32), (127 * scale).astype(np.float32)
    add = model.graph.node[-1]
    if per_channel:  # the translation's per-channel form: Max -> Min with (C, 1) bounds
        clamp = [onnx.helper.make_node("Max", ["wd", "lo"], ["wmax"]),
                 onnx.helper.make_node("Min", ["wmax", "hi"], ["wc"])]
        low, high = low.reshape(4, 1), high.reshape(4, 1)
    else:
        clamp = [onnx.helper.make_node("Clip", ["wd", "lo", "hi"], ["wc"])]
    add.input[1] = "wc"
    model.graph.node.insert(2, clamp[0])
    if per_channel:
        model.graph.node.insert(3, clamp[1])
    model.graph.initializer.extend([numpy_helper.from_array(low, "lo"), numpy_helper.from_array(high, "hi")])
    x = RNG.standard_normal(weight.shape).astype(np.float32)
    expected = run(model, {"x": x})[0]

    assert fold_quantized_weights(model) == 1  # one DequantizeLinear: its weight folded, its clamp moved
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Add"]
    stored = numpy_helper.to_array({t.name: t for t in model.graph.initializer}["W_quantized"])
    assert stored.min() == -127 and stored.max() == 127
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)


def test_fold_quantized_weights_folds_int32_zero_point_cast_to_int4() -> None:
    """Large blocked zero points reach ONNX as Cast(int32 initializer, to=INT4); the pass folds that Cast too."""
    weight = _weight_with_ties((8, 32))
    scale, zero_point, axis, block = _qparams("int4", "per_block", weight)
    model = weight_qdq_model(weight, scale, zero_point, axis, block)
    z32 = numpy_helper.from_array(zero_point.astype(np.int32), "z32")
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "z"))
    model.graph.initializer.append(z32)
    model.graph.node.insert(0, onnx.helper.make_node("Cast", ["z32"], ["z"], to=TensorProto.INT4))
    x = RNG.standard_normal(weight.shape).astype(np.float32)
    expected = run(model, {"x": x})[0]
    assert fold_quantized_weights(model) == 1
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Add"]
    stored = {t.name: t.data_type for t in model.graph.initializer}
    assert stored["W_quantized"] == TensorProto.INT4
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)


def test_fold_quantized_weights_folds_int32_bias_chain_with_constant_clip_bounds() -> None:
    """The spec's int32 bias form: DQ(Cast(Clip(Round(b / s), Constant lo, Constant hi))), saturating at int32."""
    bias = np.array([0.3, -1.26, 5e9, -5e9], np.float32)
    nodes = [
        onnx.helper.make_node("Constant", [], ["lo"], value_float=-2147483648.0),
        onnx.helper.make_node("Constant", [], ["hi"], value_float=2147483520.0),
        onnx.helper.make_node("Div", ["b", "s"], ["d"]),
        onnx.helper.make_node("Round", ["d"], ["r"]),
        onnx.helper.make_node("Clip", ["r", "lo", "hi"], ["c"]),
        onnx.helper.make_node("Cast", ["c"], ["q"], to=TensorProto.INT32),
        onnx.helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
    ]
    graph = onnx.helper.make_graph(
        nodes, "bias", [], [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(bias, "b"), numpy_helper.from_array(np.float32(0.1), "s")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    expected = run(model, {})[0]
    assert fold_quantized_weights(model) == 1
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear"]
    q = numpy_helper.to_array({t.name: t for t in model.graph.initializer}["b_quantized"])
    assert q.dtype == np.int32 and q.tolist() == [3, -13, 2147483520, -2147483648]
    np.testing.assert_array_equal(run(model, {})[0], expected)


def test_fold_quantized_weights_records_why_a_float16_weight_stays_float() -> None:
    weight = RNG.standard_normal((4, 16)).astype(np.float16)
    model = weight_qdq_model(weight, np.asarray(np.float16(0.05)), np.asarray(np.int8(0)))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    x = RNG.standard_normal(weight.shape).astype(np.float16)
    expected = run(model, {"x": x})[0]
    before = model.SerializeToString()
    count, reasons = apply_rule(model, RULE)
    assert count == 0
    assert reasons == ["weight not folded: its QuantizeLinear input is float16 (the folder quantizes float32 only)"]
    assert model.SerializeToString() == before
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)


def test_fold_quantized_weights_rewires_every_dequantize_reading_the_same_weight_to_one_initializer() -> None:
    weight = _weight_with_ties((4, 16))
    model = weight_qdq_model(weight, np.asarray(np.float32(0.02)), np.asarray(np.int8(0)))
    model.graph.node.append(onnx.helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd2"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("wd2", TensorProto.FLOAT, [4, 16]))
    x = RNG.standard_normal(weight.shape).astype(np.float32)
    expected = run(model, {"x": x})
    assert fold_quantized_weights(model) == 1  # the second DequantizeLinear reads the folded initializer already
    stored = [t.name for t in model.graph.initializer]
    assert stored.count("W_quantized") == 1 and not any(name.startswith("W_quantized_") for name in stored)
    assert [list(n.input)[0] for n in model.graph.node if n.op_type == "DequantizeLinear"] == ["W_quantized"] * 2
    for got, want in zip(run(model, {"x": x}), expected, strict=True):
        np.testing.assert_array_equal(got, want)
