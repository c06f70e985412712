"""The derived tolerance rules on hand-made graphs (what onnxruntime runs is given, so the numbers are exact)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.verify.output_steps import OutputStep, element_steps
from coreai_opt.onnx.verify.tolerance import FLOAT_PRECISION, UNDERIVED_RELATIVE, derive_tolerances


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _qparams(prefix: str) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.array(0.1, np.float32), f"{prefix}s"),
            numpy_helper.from_array(np.array(128, np.uint8), f"{prefix}z")]


def _qdq(src: str, prefix: str, out: str) -> list[onnx.NodeProto]:
    return [helper.make_node("QuantizeLinear", [src, f"{prefix}s", f"{prefix}z"], [f"{out}q"]),
            helper.make_node("DequantizeLinear", [f"{out}q", f"{prefix}s", f"{prefix}z"], [out])]


def test_exact_ops_between_quantizers_give_zero_steps() -> None:
    nodes = _qdq("x", "a", "xd") + [helper.make_node("Relu", ["xd"], ["r"]),
                                    helper.make_node("Reshape", ["r", "shape"], ["m"])] + _qdq("m", "b", "y")
    inits = _qparams("a") + _qparams("b") + [numpy_helper.from_array(np.array([1, 8], np.int64), "shape")]
    (tol,) = derive_tolerances(_model(nodes, inits), {"y"}).values()
    assert (tol.rule, tol.steps) == ("exact", 0)


def test_each_quantizer_after_float_accumulation_adds_one_step() -> None:
    weight = numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    nodes = _qdq("x", "a", "xd") + [helper.make_node("MatMul", ["xd", "w"], ["m1"])] + _qdq("m1", "b", "h")
    nodes += [helper.make_node("MatMul", ["h", "w"], ["m2"])] + _qdq("m2", "c", "y")
    inits = _qparams("a") + _qparams("b") + _qparams("c") + [weight]
    (tol,) = derive_tolerances(_model(nodes, inits), {"y"}).values()
    assert (tol.rule, tol.steps) == ("steps", 2)
    assert "MatMul x2" in tol.reason


def test_weight_only_float_output_is_judged_at_float_precision_and_names_int8_matmulnbits() -> None:
    nodes = [helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=8, N=8, bits=8,
                              block_size=16, accuracy_level=4)]
    model = _model(nodes, [])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    (tol,) = derive_tolerances(model, set()).values()
    assert (tol.rule, tol.relative) == ("float", FLOAT_PRECISION)
    assert "WARNING: MatMulNBits x1 computes differently from eager" in tol.reason


def test_float8_steps_follow_the_grid_spacing_at_the_value() -> None:
    step = OutputStep(np.array(0.5), 1, TensorProto.FLOAT8E4M3FN)
    ref = np.array([0.5 * 1.0, 0.5 * 300.0, 0.5 * 2.0**-8], np.float32)
    # e4m3fn: spacing 2^(e-3) in binade [2^e, 2^(e+1)), subnormal spacing 2^-9 below 2^-6
    assert element_steps(step, ref, ref).tolist() == [0.5 * 2.0**-3, 0.5 * 2.0**5, 0.5 * 2.0**-9]
    assert element_steps(OutputStep(np.array(0.5), 1, TensorProto.UINT16), ref, ref) == 0.5


def test_divergence_reasons_are_classified_from_the_kernel_table() -> None:
    from collections import Counter

    from coreai_opt.onnx.verify.localize import _classify

    nodes = [helper.make_node("QLinearConv", ["x"], ["a"], domain="com.microsoft"),
             helper.make_node("QuickGelu", ["a"], ["b"], domain="com.microsoft"),
             helper.make_node("Conv", ["b"], ["y"])]
    model = _model(nodes, [])
    assert _classify(Counter({"QuickGelu": 1, "Conv": 1}), model) == "float accumulation order (Conv, QuickGelu)"
    requantizing = _classify(Counter({"QLinearConv": 1, "Conv": 1}), model)
    assert requantizing == "a kernel's requantisation rounding (QLinearConv)"
    assert _classify(Counter(), model).startswith("every op between the boundaries is exact")


def _int8_layer(src: str, out: str, name: str, k: int = 8) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", [src, "b", "s"], [out], name=f"{name}_int8_emulated", domain="com.microsoft",
                            K=k, N=8, bits=8, block_size=16, accuracy_level=4)


def _int8_model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    model = _model(nodes, inits)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_int8_compute_layer_counts_one_int8_step_per_layer_after_float_ops_and_names_the_last() -> None:
    bias = numpy_helper.from_array(np.ones(8, np.float32), "bias")
    nodes = [helper.make_node("Softmax", ["x"], ["p"]), _int8_layer("p", "h", "first"),
             helper.make_node("Tanh", ["h"], ["t"]), _int8_layer("t", "m", "second"),
             helper.make_node("Add", ["m", "bias"], ["y"])]
    (tol,) = derive_tolerances(_int8_model(nodes, [bias]), set()).values()
    assert (tol.rule, tol.steps, tol.int8_layer, tol.rounds) == ("int8 compute", 2, "second_int8_emulated", 0)
    assert "2 int8 step(s) of second_int8_emulated" in tol.reason and "not derived" not in tol.reason


def test_int8_compute_layer_fed_by_exact_ops_only_allows_zero_steps() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), _int8_layer("r", "y", "only")]
    (tol,) = derive_tolerances(_int8_model(nodes, []), set()).values()
    assert (tol.rule, tol.steps) == ("int8 compute", 0)  # same A bits, same codes: float accumulation only


def test_float_layers_after_an_int8_compute_layer_are_underived_and_say_so() -> None:
    nodes = [helper.make_node("Softmax", ["x"], ["p"]), _int8_layer("p", "h", "first"),
             helper.make_node("Softmax", ["h"], ["y"])]
    (tol,) = derive_tolerances(_int8_model(nodes, []), set()).values()
    assert (tol.rule, tol.relative, tol.int8_layer) == ("underived", UNDERIVED_RELATIVE, None)
    assert "int8-compute MatMulNBits" in tol.reason and "gain is not derived" in tol.reason


def test_16_bit_quantizers_before_an_int8_compute_layer_add_no_int8_step_but_8_bit_ones_do() -> None:
    def tolerance(zero_point: np.ndarray) -> object:
        inits = [numpy_helper.from_array(np.array(0.01, np.float32), "as"), numpy_helper.from_array(zero_point, "az")]
        nodes = [helper.make_node("Softmax", ["x"], ["p"]),
                 helper.make_node("QuantizeLinear", ["p", "as", "az"], ["pq"]),
                 helper.make_node("DequantizeLinear", ["pq", "as", "az"], ["pd"]), _int8_layer("pd", "h", "layer")]
        nodes += _qdq("h", "o", "y")
        (tol,) = derive_tolerances(_int8_model(nodes, inits + _qparams("o")), {"y"}).values()
        return tol

    fine, coarse = tolerance(np.array(0, np.uint16)), tolerance(np.array(128, np.uint8))
    # Softmax -> Q rounds once (1 quantizer step); int8 codes: +1 for the inexact input, + that step if 8-bit
    assert (fine.rule, fine.steps, fine.rounds) == ("int8 compute", 1, 1)  # + 1 step of the output quantizer
    assert (coarse.rule, coarse.steps, coarse.rounds) == ("int8 compute", 2, 1)


def test_an_int8_compute_layer_with_k_above_256_on_the_path_falls_back_to_underived_and_says_why() -> None:
    nodes = [helper.make_node("Softmax", ["x"], ["p"]), _int8_layer("p", "h", "wide", k=512),
             helper.make_node("Tanh", ["h"], ["t"]), _int8_layer("t", "y", "narrow")]
    (tol,) = derive_tolerances(_int8_model(nodes, []), set()).values()
    assert (tol.rule, tol.relative) == ("underived", UNDERIVED_RELATIVE)
    assert "K = 512 > 256" in tol.reason
    nodes[1] = _int8_layer("p", "h", "wide", k=256)
    (tol,) = derive_tolerances(_int8_model(nodes, []), set()).values()
    assert (tol.rule, tol.steps) == ("int8 compute", 2)


def test_fused_dynamic_quantize_matmul_is_a_stage_of_one_step_behind_exact_ops_and_its_output_is_underived() -> None:
    # Before: DynamicQuantizeMatMul counted as a float op, so a fused w8a8_dynamic file was judged at float precision
    # (1e-4 of range) while its unfused twin (DynamicQuantizeLinear + MatMulIntegerToFloat) got 0.02 of range.
    weight = [numpy_helper.from_array(np.ones((8, 8), np.int8), "w"),
              numpy_helper.from_array(np.full(8, 0.01, np.float32), "ws")]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("DynamicQuantizeMatMul", ["r", "w", "ws"], ["y"], domain="com.microsoft")]
    model = _model(nodes, weight)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    (tol,) = derive_tolerances(model, set()).values()
    assert (tol.rule, tol.relative) == ("underived", UNDERIVED_RELATIVE)
    assert (tol.bound.steps, tol.bound.quantized) == (1, True)
    assert "DynamicQuantizeMatMul x1" in tol.reason


def test_dynamic_quantize_linear_adds_one_step_of_its_own_scale_even_behind_exact_ops() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("DynamicQuantizeLinear", ["r"], ["q", "qs", "qz"]),
             helper.make_node("DequantizeLinear", ["q", "qs", "qz"], ["y"])]
    (tol,) = derive_tolerances(_model(nodes, []), {"y"}).values()
    assert (tol.rule, tol.steps) == ("steps", 1)


def test_product_fan_out_counts_the_outputs_one_input_element_reaches() -> None:
    from coreai_opt.onnx.rewrite.graph import OnnxGraph
    from coreai_opt.onnx.verify.tolerance import product_fan_out

    weights = {"conv": np.zeros((28, 672, 1, 1), np.int8), "grouped": np.zeros((32, 4, 3, 3), np.int8),
               "gemm": np.zeros((64, 10), np.int8), "gemm_t": np.zeros((10, 64), np.int8)}
    operands = ["x", "s", "z"]
    nodes = [helper.make_node("QLinearConv", [*operands, "conv", "s", "z", "s", "z"], ["a"], domain="com.microsoft"),
             helper.make_node("QLinearConv", [*operands, "grouped", "s", "z", "s", "z"], ["b"], group=8),
             helper.make_node("QGemm", [*operands, "gemm", "s", "z", "", "s", "z"], ["c"], domain="com.microsoft"),
             helper.make_node("QGemm", [*operands, "gemm_t", "s", "z", "", "s", "z"], ["d"], domain="com.microsoft",
                              transB=1),
             helper.make_node("QLinearMatMul", [*operands, "x", "s", "z", "s", "z"], ["e"]),
             helper.make_node("Relu", ["x"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, None)],
                              [helper.make_tensor_value_info(n, TensorProto.UINT8, None) for n in "abcdef"],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph)
    assert [product_fan_out(node, OnnxGraph(model)) for node in model.graph.node] == [28, 4 * 9, 10, 10, None, None]
    for tensor in model.graph.initializer:  # weights left in a dump's external data, deleted since: dims suffice
        onnx.external_data_helper.set_external_data(tensor, "gone.data")
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
    assert [product_fan_out(node, OnnxGraph(model)) for node in model.graph.node] == [28, 4 * 9, 10, 10, None, None]
