"""rms_norms_to_simplified_layer_norm: the exported RMSNorm pattern becomes one SimplifiedLayerNormalization whose
output stays within a few float32 ulps of the elementwise graph's, and onnxruntime folds it with a residual Add."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite.rules.rms_norms_to_simplified_layer_norm import RmsNormsToSimplifiedLayerNorm
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops

RULE = RmsNormsToSimplifiedLayerNorm()
D, EPS = 64, 1e-6


def _rms_model(form: str = "reciprocal", power: float = 2.0, axis: int = -1, residual: bool = False,
               extra_reader: bool = False) -> onnx.ModelProto:
    """``x [2, 5, D] -> (Add(x, r) ->) RMSNorm`` as the exporter writes it (``form``: reciprocal or div)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, D).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(power, np.float32), "two"),
             numpy_helper.from_array(np.array([axis], np.int64), "axes"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps")]
    x = "x"
    nodes = []
    if residual:
        nodes.append(helper.make_node("Add", ["x", "r"], ["h"], name="residual"))
        x = "h"
    nodes += [helper.make_node("Pow", [x, "two"], ["sq"], name="pow"),
              helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], name="mean", keepdims=1),
              helper.make_node("Add", ["mean", "eps"], ["var"], name="add_eps"),
              helper.make_node("Sqrt", ["var"], ["root"], name="sqrt")]
    if form == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["root"], ["inv"], name="rsqrt"),
                  helper.make_node("Mul", [x, "inv"], ["normed"], name="normalise")]
    else:
        nodes.append(helper.make_node("Div", [x, "root"], ["normed"], name="normalise"))
    nodes.append(helper.make_node("Mul", ["w", "normed"], ["y"], name="scale"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, D])]
    if residual:  # the residual stream goes on: y + h, as the next block's residual Add reads it
        nodes.append(helper.make_node("Add", ["y", "h"], ["out"], name="next_residual"))
        outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 5, D])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, [2, 5, 1]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, D]) for n in ("x", "r")[:1 + residual]]
    graph = helper.make_graph(nodes, "rms", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _feeds(residual: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"x": (rng.standard_normal((2, 5, D)) * 3).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((2, 5, D)).astype(np.float32)
    return feeds


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return w * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)


def test_the_reciprocal_form_becomes_the_div_form_onnxruntime_fuses_within_a_few_ulps(tmp_path) -> None:
    model = _rms_model("reciprocal")
    before = copy(model)
    assert apply_rule(model, RULE) == (1, [])
    assert ops(model) == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]
    assert list(model.graph.node[4].input) == ["x", "root"]
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node] == [
        "SimplifiedLayerNormalization"]
    feeds = _feeds()
    (fused,), (plain,) = session.run(None, feeds), run(before, feeds)
    exact = _reference(feeds["x"], numpy_helper.to_array(model.graph.initializer[0]))
    ulp = np.spacing(np.abs(exact).astype(np.float32))
    assert np.max(np.abs(fused - exact) / ulp) <= 4  # the fused kernel: within 4 ulps of the float64 RMSNorm
    assert np.max(np.abs(fused - plain) / ulp) <= 8  # and of the elementwise graph
    assert_idempotent(model, RULE)


def test_the_div_form_without_a_residual_add_is_left_to_onnxruntime() -> None:
    model = _rms_model("div")
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [])
    assert model.SerializeToString() == before


@pytest.mark.parametrize("form", ["reciprocal", "div"])
def test_a_residual_add_before_the_norm_is_folded_in_as_skip_simplified_layer_norm_with_the_exact_sum(form) -> None:
    model = _rms_model(form, residual=True)
    assert apply_rule(model, RULE) == (1, [])
    assert ops(model) == ["SkipSimplifiedLayerNormalization", "Add"]
    skip = model.graph.node[0]
    assert (list(skip.input), list(skip.output), skip.domain) == (["x", "r", "w"], ["y", "", "", "h"],
                                                                  "com.microsoft")
    feeds = _feeds(residual=True)
    h = feeds["x"] + feeds["r"]
    extended = copy(model)  # expose the norm and the sum to compare them one by one
    extended.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, D]) for n in "yh"])
    _, y, h_out = run(extended, feeds)
    np.testing.assert_array_equal(h_out, h)  # the residual stream is the same float add
    exact = _reference(h, numpy_helper.to_array(model.graph.initializer[0]))
    assert np.max(np.abs(y - exact) / np.spacing(np.abs(exact).astype(np.float32))) <= 4
    assert_idempotent(model, RULE)


@pytest.mark.parametrize(("options", "reason"), [
    ({"power": 3.0}, "the power is not 2"),
    ({"axis": 1}, "the mean is not over the last axis alone with keepdims"),
    ({"extra_reader": True}, "an intermediate value of the norm has another reader"),
])
def test_near_misses_name_the_check_and_leave_the_graph_unchanged(options: dict, reason: str) -> None:
    model = _rms_model(**options)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [reason])
    assert model.SerializeToString() == before
