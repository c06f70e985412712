"""Per-token dynamic activations: PerToken granularity, the eager op, and its ONNX form in onnxruntime, bit for bit."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from coreai_opt.quantization.ops.dynamic_quantize_op import (
    dynamic_qparams,
    dynamic_quantize_dequantize,
    dynamic_quantize_dequantize_per_token,
    dynamic_quantize_dequantize_translation_table,
)
from coreai_opt.quantization.spec import PerToken, QuantizationSpec, granularity_from_dict

K = 48


class _Quantizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fq = DynamicFakeQuantize(dynamic_activation_spec(PerToken()))
        self.fq.set_export_mode(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.fq(x)


@pytest.fixture(scope="module")
def ort_per_token() -> ort.InferenceSession:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.onnx.export(_Quantizer().eval(), (torch.randn(2, 3, K),), dynamo=True, opset_version=21,
                                dynamic_shapes=({0: batch, 1: seq},),
                                custom_translation_table=dynamic_quantize_dequantize_translation_table(21))
    return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _rows() -> torch.Tensor:
    """(4, 40, K) rows: random widths and offsets, an all-zero row, one-sided rows, exact ties of x / s and of z."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 40, K, generator=gen) * torch.rand(4, 40, 1, generator=gen) * 20
    x = x + torch.randn(4, 40, 1, generator=gen) * 3
    x[0, 0] = 0.0                                                     # all zero: s = 1, z = 0, no NaN
    x[0, 1] = x[0, 1].abs()                                           # only positive: z = 0
    x[0, 2] = -x[0, 2].abs()                                          # only negative: z = 255
    x[1, 0] = torch.linspace(-127.5, 127.5, K)                        # s = 1, z = round(127.5) = 128 (to even)
    x[1, 1, :] = 0.5
    x[1, 1, :4] = torch.tensor([254.5, 0.0, 255.0, 2.5])              # s = 1, z = 0: x / s = 254.5, 2.5, 0.5 ties
    x[1, 2, :3] = torch.tensor([-1.0, 509.0, 3.0])                    # z tie 0.5 -> 0
    x[1, 2, 3:] = 0.0
    x[1, 3, :3] = torch.tensor([-3.0, 507.0, 1.0])                    # z tie 1.5 -> 2
    x[1, 3, 3:] = 0.0
    x[1, 4, :2] = torch.tensor([-5.0, 505.0])                         # z tie 2.5 -> 2
    x[1, 4, 2:] = 0.0
    return x


def test_per_token_granularity_has_one_qparam_per_row_of_the_last_axis() -> None:
    g = PerToken()
    assert g.qparam_shape((2, 7, K)) == (2, 7, 1)
    assert g.qparam_shape((K,)) == (1,)
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    assert torch.equal(g.to_rows(x), x.reshape(6, 4))
    assert torch.equal(g.from_rows(torch.arange(6.0), x.shape), torch.arange(6.0).reshape(2, 3, 1))
    assert g.onnx_axis(3) == 2
    assert granularity_from_dict(g.to_dict()) == g and g.to_dict() == {"type": "per_token"}
    with pytest.raises(ValueError, match="rank >= 1"):
        g.qparam_shape(())


def test_per_token_needs_the_dynamic_calculator() -> None:
    with pytest.raises(ValueError, match="qparams_calculator='dynamic'"):
        QuantizationSpec(dtype="uint8", qscheme="asymmetric", granularity=PerToken())
    spec = dynamic_activation_spec(PerToken())
    assert QuantizationSpec.from_dict(spec.to_dict()) == spec


def test_per_token_codes_bit_exact_with_onnxruntime(ort_per_token: ort.InferenceSession) -> None:
    x = _rows()
    eager = dynamic_quantize_dequantize_per_token(x)
    for sample in (x, x[:1, :5], x[2:, 7:8]):  # several extents through one file
        (y,) = ort_per_token.run(None, {"x": sample.numpy()})
        np.testing.assert_array_equal(y, dynamic_quantize_dequantize_per_token(sample).numpy())
    assert torch.isfinite(eager).all() and torch.equal(eager[0, 0], torch.zeros(K))
    scale, zero_point = dynamic_qparams(x, per_token=True)
    assert scale[1, 0].item() == 1.0 and zero_point[1, 0].item() == 128
    assert zero_point[1, 2].item() == 0 and zero_point[1, 3].item() == 2 and zero_point[1, 4].item() == 2
    assert scale[0, 0].item() == 1.0 and zero_point[0, 0].item() == 0
    assert zero_point[0, 1].item() == 0 and zero_point[0, 2].item() == 255
    assert scale[1, 1].item() == 1.0 and zero_point[1, 1].item() == 0
    assert eager[1, 1, :5].tolist() == [254.0, 0.0, 255.0, 2.0, 0.0]  # round half to even: 254.5, 2.5, 0.5


def test_each_row_is_rounded_as_if_it_were_alone() -> None:
    x = _rows()
    full = dynamic_quantize_dequantize_per_token(x)
    for b, t in ((0, 3), (2, 39), (3, 17)):
        assert torch.equal(dynamic_quantize_dequantize_per_token(x[b : b + 1, t : t + 1]), full[b : b + 1, t : t + 1])
        # the same row is a single call of the per-tensor op: per token = per tensor of one token
        assert torch.equal(dynamic_quantize_dequantize(x[b, t].clone()), full[b, t])
    # per tensor, the last token's codes depend on the other tokens of the call (the cache / no-cache split)
    assert not torch.equal(dynamic_quantize_dequantize(x[2:3, 39:40]), dynamic_quantize_dequantize(x[2:3])[:, 39:40])


def test_module_qparams_are_the_ops_per_row() -> None:
    x = _rows()[2:]
    fq = DynamicFakeQuantize(dynamic_activation_spec(PerToken()))
    scale, zero_point = fq.qparams(x)
    expected_scale, expected_zero = dynamic_qparams(x, per_token=True)
    assert scale.shape == (2, 40, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert torch.equal(zero_point.to(torch.int32), expected_zero)
    assert torch.equal(fq(x), dynamic_quantize_dequantize_per_token(x))
