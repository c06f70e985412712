"""dynamic_matmuls_to_integer: DynamicQuantizeLinear -> DQ -> MatMul(DQ(int8 W)) becomes DynamicQuantizeMatMul."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite.rules.dynamic_matmuls_to_integer import DynamicMatmulsToInteger
from coreai_opt.quantization.ops.dynamic_quantize_op import dynamic_quantize_dequantize
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy

K, N = 32, 24
RULE = DynamicMatmulsToInteger()


def _model(weight_zero: int = 0, transposed: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (N, K) if transposed else (K, N)).astype(np.int8)
    scale = (rng.random(N).astype(np.float32) + 0.5) / 50
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(np.full(N, weight_zero, np.int8), "wz"),
             numpy_helper.from_array(rng.random(N).astype(np.float32), "b")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["wd"], axis=0 if transposed else 1)]
    if transposed:
        nodes.append(helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]))
    nodes += [helper.make_node("MatMul", ["xd", "wt" if transposed else "wd"], ["mm"]),
              helper.make_node("Add", ["mm", "b"], ["y"]),
              helper.make_node("Relu", ["xd"], ["r"])]  # a second, non-matmul consumer of the DQ output
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, N]),
                               helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 5, K])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray, tmp_path, name: str) -> tuple[list[np.ndarray], list[str]]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    outs = sess.run(None, {"x": x})
    return outs, [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


@pytest.mark.parametrize("transposed", [True, False])
def test_rewrite_fuses_and_keeps_values(tmp_path, transposed: bool) -> None:
    x = np.random.default_rng(1).standard_normal((2, 5, K)).astype(np.float32) * 3
    model = _model(transposed=transposed)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    x_dq = dynamic_quantize_dequantize(torch.from_numpy(x)).double().numpy()
    w = inits["W"].astype(np.float64) * (inits["ws"][:, None] if transposed else inits["ws"][None, :])
    reference = [x_dq @ (w.T if transposed else w) + inits["b"], np.maximum(x_dq, 0)]
    before = run(model, {"x": x})  # onnxruntime without graph optimizations: the QDQ arithmetic as written
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model)
    assert "Transpose" not in [n.op_type for n in model.graph.node]  # the dead weight path is removed
    outs, ops = _run(model, x, tmp_path, "fused")
    assert "DynamicQuantizeMatMul" in ops or "MatMulIntegerToFloat" in ops
    np.testing.assert_allclose(outs[0], reference[0], rtol=1e-5, atol=1e-4)  # float32 summation order only
    np.testing.assert_array_equal(outs[1], reference[1].astype(np.float32))  # other consumer reads the DQ
    after = run(model, {"x": x})
    np.testing.assert_allclose(after[0], before[0], rtol=1e-5, atol=1e-4)  # float32 summation order only
    np.testing.assert_array_equal(after[1], before[1])
    assert_idempotent(model, RULE)


def test_nonzero_weight_zero_point_is_left_alone_with_its_reason() -> None:
    model = _model(weight_zero=3)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, ["weight zero point is not 0"])
    assert model.SerializeToString() == before


def _per_token_model(block: int = K) -> onnx.ModelProto:
    """x -> per-row (s, z) as the per-token translation writes them -> blocked Q / DQ -> MatMul(DQ(int8 W)ᵀ) + b."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (N, K)).astype(np.int8)
    scale = (rng.random(N).astype(np.float32) + 0.5) / 50
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(np.zeros(N, np.int8), "wz"),
             numpy_helper.from_array(rng.random(N).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([-1], np.int64), "last"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(255.0, np.float32), "top")]
    blocked = {"axis": -1, "block_size": block}
    nodes = [helper.make_node("ReduceMax", ["x", "last"], ["mx0"], keepdims=1),
             helper.make_node("ReduceMin", ["x", "last"], ["mn0"], keepdims=1),
             helper.make_node("Max", ["mx0", "zero"], ["mx"]), helper.make_node("Min", ["mn0", "zero"], ["mn"]),
             helper.make_node("Sub", ["mx", "mn"], ["d0"]), helper.make_node("Div", ["d0", "top"], ["d"]),
             helper.make_node("Greater", ["d", "zero"], ["pos"]), helper.make_node("Where", ["pos", "d", "one"], ["s"]),
             helper.make_node("Div", ["mn", "s"], ["mns"]), helper.make_node("Sub", ["zero", "mns"], ["zf0"]),
             helper.make_node("Clip", ["zf0", "zero", "top"], ["zf1"]), helper.make_node("Round", ["zf1"], ["zf"]),
             helper.make_node("Cast", ["zf"], ["z"], to=TensorProto.UINT8),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **blocked),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"], **blocked),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xd", "wt"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, N])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_per_token_rewrite_is_integer_and_keeps_values(tmp_path) -> None:
    from coreai_opt.quantization.ops.dynamic_quantize_op import dynamic_quantize_dequantize_per_token

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 5, K)) * rng.random((2, 5, 1)) * 6 + rng.standard_normal((2, 5, 1))).astype(np.float32)
    x[0, 1] = 0.0  # an all-zero row: s = 1, z = 0
    x[1, 2] = np.abs(x[1, 2])  # a one-sided row: z = 0
    model = _per_token_model()
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    x_dq = dynamic_quantize_dequantize_per_token(torch.from_numpy(x)).double().numpy()
    reference = x_dq @ (inits["W"].astype(np.float64) * inits["ws"][:, None]).T + inits["b"]
    before = run(model, {"x": x})
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulInteger" in ops and "MatMul" not in ops and ops.count("DequantizeLinear") == 0
    outs, _ = _run(model, x, tmp_path, "per_token")
    np.testing.assert_allclose(outs[0], reference, rtol=1e-5, atol=1e-4)  # float32 summation order only
    np.testing.assert_allclose(run(model, {"x": x})[0], before[0], rtol=1e-5, atol=1e-4)
    assert_idempotent(model, RULE)


def test_per_token_block_other_than_k_is_a_near_miss_with_its_reason() -> None:
    model = _per_token_model(block=K // 2)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [f"per-token block size {K // 2} is not the product's K = {K}"])
    assert model.SerializeToString() == before


def test_per_token_stage_counts_as_one_quantizer_stage_in_the_tolerance() -> None:
    from coreai_opt.onnx.verify.tolerance import tensor_bounds

    model = _per_token_model()
    assert apply_rule(model, RULE) == (1, [])
    exact = tensor_bounds(model)
    assert exact["q"].quantized and exact["q"].steps == 0  # exact input rows: eager and onnxruntime codes equal
    assert exact["y"].quantized  # the product behind it is judged as quantized, never at float precision
    inexact = copy(model)  # the same graph behind an inexact op (Exp): the stage may round one step apart
    for node in inexact.graph.node:
        node.input[:] = ["xe" if name == "x" else name for name in node.input]
    inexact.graph.node.insert(0, helper.make_node("Exp", ["x"], ["xe"]))
    assert tensor_bounds(inexact)["q"].steps == 1
