"""guard_float8_activations: a Relu / Clip before a float8 or 4-bit QuantizeLinear survives onnxruntime's optimizer."""

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.rewrite.rules.guard_float8_activations import GuardFloat8Activations
from coreai_opt.reference_models import DigitsCNN
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent


def _converted(model: nn.Module, preset: str, shape: tuple[int, ...]):
    torch.manual_seed(0)
    example = (torch.randn(2, *shape),)
    prepared = co.prepare(model.eval(), co.QuantizerConfig.presets.get(preset)(), example)
    co.calibrate(prepared, [torch.randn(16, *shape) for _ in range(3)], progress=False)
    return co.convert(prepared), example


class _ConvRelu6(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU6()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x) * 4))


@pytest.mark.parametrize(("model", "shape"), [(DigitsCNN, (1, 8, 8)), (_ConvRelu6, (3, 8, 8))], ids=["relu", "relu6"])
def test_fp8_export_keeps_relu_semantics_in_onnxruntime_with_all_optimizations(tmp_path, model, shape):
    converted, example = _converted(model(), "fp8", shape)
    path = co.export_onnx(converted, example, tmp_path / "fp8.onnx")
    ops = Counter(n.op_type for n in onnx.load(path).graph.node)
    assert ops["Relu"] == 0 and ops["Clip"] == 0 and ops["Max"] >= 1  # rewritten, so onnxruntime cannot drop them
    x = torch.randn(32, *shape) * 3
    expected = converted(x).detach().numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # default: ORT_ENABLE_ALL
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    if model is DigitsCNN:
        np.testing.assert_array_equal(got, expected)  # measured bit-exact (before the guard: max diff 0.154)
    else:
        # float conv accumulation differs between torch and onnxruntime, flipping a few float8 roundings
        # (measured 11 of 8192 values, each by one float8 step: relative 0.1 for e4m3's 3 mantissa bits)
        diff = np.abs(got - expected)
        assert (diff > 0).mean() < 0.01
        assert np.all(diff <= 0.125 * np.abs(expected) + 1e-4)


def test_guard_leaves_uint8_activations_alone(tmp_path):
    converted, example = _converted(_ConvRelu6(), "w8a8_sym", (3, 8, 8))
    ops = Counter(n.op_type for n in onnx.load(co.export_onnx(converted, example, tmp_path / "i8.onnx")).graph.node)
    assert ops["Max"] == 0 and ops["Min"] == 0


def _activation_graph(op: str, zero_point: np.ndarray | None, bounds: tuple[str, ...] = ()) -> onnx.ModelProto:
    """``x -> Relu / Clip -> QuantizeLinear(zero_point) -> DequantizeLinear``."""
    inits = [numpy_helper.from_array(np.float32(0.25), "s"), numpy_helper.from_array(np.float32(-1.0), "lo"),
             numpy_helper.from_array(np.float32(6.0), "hi")]
    qparams = ["s"]
    if zero_point is not None:
        inits.append(numpy_helper.from_array(zero_point, "z"))
        qparams.append("z")
    nodes = [helper.make_node(op, ["x", *bounds], ["a"], name="act"),
             helper.make_node("QuantizeLinear", ["a", *qparams], ["q"]),
             helper.make_node("DequantizeLinear", ["q", *qparams], ["y"])]
    graph = helper.make_graph(nodes, "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


RULE = GuardFloat8Activations()
X = np.linspace(-8, 8, 64, dtype=np.float32).reshape(4, 16)


@pytest.mark.parametrize(("op", "bounds", "expected_ops"), [
    ("Relu", (), ["Max"]), ("Clip", ("lo", "hi"), ["Max", "Min"]), ("Clip", ("", "hi"), ["Min"]),
    ("Clip", ("lo",), ["Max"]),
])
@pytest.mark.parametrize("zero_point", [np.array(0, ml_dtypes.float8_e4m3fn), np.array(0, ml_dtypes.int4)],
                         ids=["float8e4m3fn", "int4"])
def test_activation_before_a_float8_or_int4_quantizer_is_spelled_with_max_min(
        op: str, bounds: tuple[str, ...], expected_ops: list[str], zero_point: np.ndarray) -> None:
    model = _activation_graph(op, zero_point, bounds)
    (expected,) = run(model, {"x": X})
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node][:-2] == expected_ops
    for optimize in (False, True):  # optimized: onnxruntime no longer drops the activation
        np.testing.assert_array_equal(run(model, {"x": X}, optimize)[0], expected)
    assert_idempotent(model, RULE)


def test_activation_before_a_uint8_quantizer_is_left_alone() -> None:
    model = _activation_graph("Relu", np.array(0, np.uint8))
    assert apply_rule(model, RULE) == (0, [])
    assert [n.op_type for n in model.graph.node] == ["Relu", "QuantizeLinear", "DequantizeLinear"]


def test_activation_before_a_quantizer_of_unknown_type_is_left_alone_with_its_reason() -> None:
    model = _activation_graph("Relu", np.array(0, np.uint8))
    model.graph.node[1].input[2] = "x_zero"  # a zero point computed at run time
    model.graph.node.insert(0, helper.make_node("Cast", ["zero_f"], ["x_zero"], to=TensorProto.FLOAT8E4M3FN))
    model.graph.input.append(helper.make_tensor_value_info("zero_f", TensorProto.FLOAT, []))
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (
        0, ["the QuantizeLinear reading it has a zero point that is not a constant (type unknown)"])
    assert model.SerializeToString() == before
