"""QdqView: one decode of a Q/DQ node (qparams, axis, block size, quantized type, granularity, constness)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView


def _graph(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray]) -> OnnxGraph:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return OnnxGraph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


CASES = {  # name: (numpy dtype, ONNX type, bits, signed, is_float)
    "int8": (np.int8, TensorProto.INT8, 8, True, False),
    "uint8": (np.uint8, TensorProto.UINT8, 8, False, False),
    "int16": (np.int16, TensorProto.INT16, 16, True, False),
    "uint16": (np.uint16, TensorProto.UINT16, 16, False, False),
    "int4": (ml_dtypes.int4, TensorProto.INT4, 4, True, False),
    "uint4": (ml_dtypes.uint4, TensorProto.UINT4, 4, False, False),
    "float8e4m3fn": (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN, 8, True, True),
    "float8e5m2": (ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2, 8, True, True),
}
GRANULARITIES = {  # name: (scale shape, attributes, granularity)
    "per_tensor": ((), {}, "per_tensor"),
    "per_axis": ((4,), {"axis": 0}, "per_axis"),
    "blocked": ((4, 2), {"axis": 1, "block_size": 4}, "blocked"),
}


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("dtype", list(CASES))
def test_dequantize_of_a_constant_weight_decodes_type_granularity_and_qparams(dtype: str, granularity: str) -> None:
    np_dtype, onnx_type, bits, signed, is_float = CASES[dtype]
    scale_shape, attrs, expected = GRANULARITIES[granularity]
    scale = np.full(scale_shape, 0.5, np.float32)
    zero_point = np.zeros(scale_shape, np_dtype)
    graph = _graph([helper.make_node("DequantizeLinear", ["w", "s", "z"], ["y"], **attrs)],
                   {"w": np.zeros((4, 8), np_dtype), "s": scale, "z": zero_point})
    view = QdqView.of(graph.producer("y"), graph)
    assert (view.data, view.scale_name, view.zero_point_name) == ("w", "s", "z")
    assert view.is_dequantize and view.data_is_constant and view.has_constant_qparams and view.zero_point_is_zero
    assert view.quant_type == onnx_type and view.type_name == dtype
    assert (view.type_info.bits, view.type_info.signed, view.type_info.is_float) == (bits, signed, is_float)
    assert view.granularity == expected
    assert (view.axis, view.block_size) == (attrs.get("axis", 1), attrs.get("block_size", 0))
    np.testing.assert_array_equal(view.scale, scale)
    assert view.zero_point.dtype == np.dtype(np_dtype)


def test_quantize_type_comes_from_zero_point_then_output_dtype_then_uint8() -> None:
    graph = _graph([
        helper.make_node("QuantizeLinear", ["x", "s", "z16"], ["q16"]),
        helper.make_node("QuantizeLinear", ["x", "s"], ["q_fp8"], output_dtype=TensorProto.FLOAT8E4M3FN),
        helper.make_node("QuantizeLinear", ["x", "s"], ["q_default"]),
        helper.make_node("QuantizeLinear", ["x", "s", "x"], ["q_unknown"]),  # zero point not a constant
    ], {"s": np.float32(0.1), "z16": np.int16(3)})
    views = {name: QdqView.of(graph.producer(name), graph) for name in ("q16", "q_fp8", "q_default", "q_unknown")}
    assert views["q16"].quant_type == TensorProto.INT16 and not views["q16"].zero_point_is_zero
    assert views["q_fp8"].quant_type == TensorProto.FLOAT8E4M3FN
    assert views["q_default"].quant_type == TensorProto.UINT8 and views["q_default"].zero_point_name is None
    assert views["q_unknown"].quant_type is None and views["q_unknown"].type_name == "unknown"
    assert not views["q_unknown"].has_constant_qparams and not views["q_unknown"].zero_point_is_zero
    assert not views["q16"].is_dequantize and not views["q16"].data_is_constant


def test_dequantize_of_an_activation_takes_its_type_from_the_zero_point() -> None:
    graph = _graph([
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["xq", "x"], ["no_scale"]),  # scale computed at run time
    ], {"s": np.float32(0.1), "z": np.array(128, np.uint8)})
    view = QdqView.of(graph.producer("xd"), graph)
    assert view.quant_type == TensorProto.UINT8 and not view.data_is_constant and view.granularity == "per_tensor"
    no_scale = QdqView.of(graph.producer("no_scale"), graph)
    assert no_scale.scale is None and no_scale.granularity is None and no_scale.quant_type is None


def test_only_default_domain_quantize_and_dequantize_nodes_are_decoded() -> None:
    graph = _graph([helper.make_node("Relu", ["x"], ["r"]),
                    helper.make_node("DequantizeLinear", ["w", "s"], ["y"], domain="com.microsoft")],
                   {"w": np.zeros(3, np.int8), "s": np.float32(1.0)})
    assert QdqView.of(graph.producer("r"), graph) is None
    assert QdqView.of(graph.producer("y"), graph) is None
    assert QdqView.of(None, graph) is None
