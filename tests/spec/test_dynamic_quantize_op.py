"""coreai_opt::dynamic_quantize_dequantize vs onnxruntime DynamicQuantizeLinear -> DequantizeLinear, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from coreai_opt.quantization.fake_quantize.fake_quantize import FAKE_QUANTIZE
from coreai_opt.quantization.ops.dynamic_quantize_op import (
    dynamic_qparams,
    dynamic_quantize_dequantize,
    dynamic_quantize_dequantize_translation_table,
)
from coreai_opt.quantization.spec import QuantizationSpec, get_dtype_info


@pytest.fixture(scope="module")
def ort_dynamic_qdq() -> ort.InferenceSession:
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("z", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for _ in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 20
        shift = float(torch.randn(1, generator=gen)) * 5
        cases.append(torch.randn(n, generator=gen) * scale + shift)
    cases += [
        torch.zeros(9),                               # all zero: onnxruntime uses s = 1, z = 0
        torch.full((5,), 3.0), torch.full((5,), -2.0),  # one-sided ranges
        torch.arange(-255, 256, dtype=torch.float32) / 2,  # exact ties of x / s
        torch.tensor([-1.0, 509.0, 3.0]),             # zero point tie 0.5 -> 0 (half to even)
        torch.tensor([-3.0, 507.0, 1.0]),             # zero point tie 1.5 -> 2
        torch.tensor([-5.0, 505.0]),                  # zero point tie 2.5 -> 2
        torch.randn(2, 7, 48) * 30,
    ]
    return cases


def test_bit_exact_with_onnxruntime(ort_dynamic_qdq: ort.InferenceSession) -> None:
    for x in _cases():
        y, s, z = ort_dynamic_qdq.run(None, {"x": x.numpy()})
        scale, zero_point = dynamic_qparams(x)
        assert scale.item() == s.item() and zero_point.item() == int(z), x[:4]
        np.testing.assert_array_equal(dynamic_quantize_dequantize(x).numpy(), y)


def test_values_on_the_uint8_grid() -> None:
    x = torch.randn(1000) * 4 + 1
    scale, zero_point = dynamic_qparams(x)
    q = dynamic_quantize_dequantize(x) / scale + zero_point
    assert torch.allclose(q, q.round(), atol=1e-3)
    assert q.min() >= -1e-3 and q.max() <= 255 + 1e-3


def test_straight_through_gradient() -> None:
    x = (torch.randn(50) * 3).requires_grad_()
    dynamic_quantize_dequantize(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_rejects_non_float32() -> None:
    with pytest.raises(TypeError, match="float32"):
        dynamic_quantize_dequantize(torch.randn(4, dtype=torch.float64))


class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dynamic_quantize_dequantize(x) * 2.0


def test_export_emits_dynamic_quantize_linear_and_matches(tmp_path) -> None:
    x = torch.randn(3, 16) * 5
    program = torch.onnx.export(_Model(), (x,), dynamo=True, opset_version=18, verbose=False,
                                custom_translation_table=dynamic_quantize_dequantize_translation_table(18))
    ops = [n.op_type for n in program.model_proto.graph.node]
    assert "DynamicQuantizeLinear" in ops and "DequantizeLinear" in ops
    path = tmp_path / "m.onnx"
    onnx.save(program.model_proto, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(5):
        x = torch.randn(3, 16) * 7 - 1
        np.testing.assert_array_equal(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0],
                                      _Model()(x).numpy())


def test_translation_table_rejects_old_opset() -> None:
    with pytest.raises(ValueError, match="opset >= 11"):
        dynamic_quantize_dequantize_translation_table(10)


def test_dynamic_fake_quantize_registered_and_matches_calculator() -> None:
    assert FAKE_QUANTIZE.get_class("dynamic") is DynamicFakeQuantize
    fq = FAKE_QUANTIZE.get_class("dynamic").from_spec(dynamic_activation_spec())
    for _ in range(10):
        x = torch.randn(4, 33) * 6 + 0.5
        scale, zero_point = fq.qparams(x)
        ref_scale, ref_zp = dynamic_qparams(x)
        assert torch.equal(scale, ref_scale) and torch.equal(zero_point, ref_zp)
        assert torch.equal(fq(x), dynamic_quantize_dequantize(x))


def test_dynamic_fake_quantize_flags_and_export_mode() -> None:
    fq = DynamicFakeQuantize(dynamic_activation_spec())
    x = torch.randn(8) * 3
    fq.enable_fake_quant(False)
    assert torch.equal(fq(x), x)
    fq.set_export_mode(True)  # no calibration needed
    assert fq.export_mode and torch.equal(fq(x), dynamic_quantize_dequantize(x))
    assert torch.equal(fq(x.half()).float(), dynamic_quantize_dequantize(x.half().float()).half().float())


def test_dynamic_fake_quantize_rejects_other_specs() -> None:
    bad = QuantizationSpec(dtype="int8", qscheme="symmetric", qparams_calculator="dynamic")
    with pytest.raises(ValueError, match="uint8.*asymmetric.*per-tensor"):
        DynamicFakeQuantize(bad)
    static = dynamic_activation_spec().model_copy(update={"qparams_calculator": "static"})
    with pytest.raises(ValueError, match="stateless"):
        DynamicFakeQuantize(static)
    assert get_dtype_info(dynamic_activation_spec().dtype).quant_max == 255
