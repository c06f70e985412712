"""Hand-made ONNX QDQ graphs (onnx.helper) and an onnxruntime runner for the ONNX-level tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimize: bool = False) -> list[np.ndarray]:
    """Run a model in onnxruntime (CPU); graph optimizations off unless ``optimize``."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def weight_qdq_model(weight: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int = 0,
                     block_size: int = 0, opset: int = 21) -> onnx.ModelProto:
    """``y = x + DequantizeLinear(QuantizeLinear(W))`` with W, scale, zero point as initializers."""
    attrs = {} if scale.size == 1 and scale.ndim == 0 else {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    nodes = [
        helper.make_node("QuantizeLinear", ["W", "s", "z"], ["wq"], **attrs),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], **attrs),
        helper.make_node("Add", ["x", "wd"], ["y"]),
    ]
    inits = [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(scale, "s"),
             numpy_helper.from_array(zero_point, "z")]
    shape = list(weight.shape)
    graph = helper.make_graph(nodes, "weight_qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def conv_qdq_model(float_weight_q: bool = True, with_output_q: bool = True, seed: int = 0) -> onnx.ModelProto:
    """uint8 QDQ conv: Q/DQ input, Q/DQ int8 per-channel weight, int32 bias as DQ(Cast(Round(b / (s_x * s_w))))."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    w_scale = (np.abs(weight).reshape(8, -1).max(1) / 127).astype(np.float32)
    inits = [
        numpy_helper.from_array(weight, "conv.weight"), numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w_zp"), numpy_helper.from_array(np.float32(0.02), "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"), numpy_helper.from_array(np.float32(0.05), "y_scale"),
        numpy_helper.from_array(np.uint8(128), "y_zp"), numpy_helper.from_array(bias, "conv.bias"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("QuantizeLinear", ["conv.weight", "w_scale", "w_zp"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], axis=0),
        helper.make_node("Mul", ["x_scale", "w_scale"], ["b_scale"]),
        helper.make_node("Div", ["conv.bias", "b_scale"], ["b_div"]),
        helper.make_node("Round", ["b_div"], ["b_round"]),
        helper.make_node("Cast", ["b_round"], ["b_int"], to=TensorProto.INT32),
        helper.make_node("DequantizeLinear", ["b_int", "b_scale"], ["bd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], pads=[1, 1, 1, 1], name="conv1"),
    ]
    if not float_weight_q:  # weight already stored as int8: the pass has nothing to fold for it
        q = np.clip(np.rint(weight / w_scale[:, None, None, None]), -128, 127).astype(np.int8)
        inits[0] = numpy_helper.from_array(q, "conv.weight_int8")
        nodes[2:4] = [helper.make_node("DequantizeLinear", ["conv.weight_int8", "w_scale", "w_zp"], ["wd"], axis=0)]
    if with_output_q:
        nodes += [helper.make_node("QuantizeLinear", ["c", "y_scale", "y_zp"], ["cq"]),
                  helper.make_node("DequantizeLinear", ["cq", "y_scale", "y_zp"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 8, 8])]
    graph = helper.make_graph(nodes, "conv_qdq", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path
