"""Complex rotary embeddings carried as real pairs (coreai_opt.passes.complex_as_real): they export and verify."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.passes.capture import capture
from coreai_opt.passes.complex_as_real import complex_as_real


class _ComplexRotary(nn.Module):
    """Llama-reference rotary: a ``polar`` table, ``view_as_complex`` on q, a complex product, ``view_as_real``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the weights, so the SQNR below does not depend on the tests run before
        self.q = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, dtype=torch.float32) / 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 16), two heads of 8
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq
        table = torch.polar(torch.ones_like(angles), angles)  # (seq, 4) complex
        q = self.q(x).unflatten(-1, (2, 8))  # (batch, seq, heads, 8)
        z = torch.view_as_complex(q.unflatten(-1, (-1, 2)))  # (batch, seq, heads, 4)
        rotated = torch.view_as_real(z * table[:, None, :]).flatten(-3)
        return self.out(rotated)


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_the_rewritten_graph_has_no_complex_tensor_and_computes_the_complex_model_within_float32_rounding(method):
    model, x = _ComplexRotary().eval(), _inputs(0)
    gm = capture(model, (x,), method=method)
    assert complex_as_real(gm).changes > 0
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        assert meta is None or not getattr(meta, "dtype", torch.float32).is_complex, node
    with torch.no_grad():
        expected, got = model(x), gm(x)
    assert torch.allclose(got, expected, rtol=0, atol=2e-6), (got - expected).abs().max()


def test_an_op_the_pass_does_not_know_on_a_complex_tensor_leaves_the_whole_graph_unchanged():
    class Magnitude(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.view_as_complex(x.unflatten(-1, (-1, 2))).abs()  # abs of a complex: not rewritten

    x = torch.randn(3, 8)
    gm = capture(Magnitude(), (x,), method="export")
    before = gm.code
    assert complex_as_real(gm).changes == 0
    assert gm.code == before


def test_a_complex_rotary_model_exports_and_onnxruntime_agrees_with_eager(tmp_path):
    """torch's exporter translates no op on a complex tensor; after prepare, the file runs and verify passes."""
    model = _ComplexRotary().eval()
    with pytest.raises(Exception, match="(?i)complex|unsqueeze|translat|convert"):
        torch.onnx.export(model, (_inputs(0),), str(tmp_path / "float.onnx"), dynamo=True, verbose=False)
    calibration = [(_inputs(seed),) for seed in range(4)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), calibration[0])
    co.calibrate(prepared, calibration, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, calibration[0], tmp_path / "rotary.onnx")
    report = co.verify_onnx(converted, path, [(_inputs(9),)])
    assert report.ok, report
    with torch.no_grad():
        float_out, quantized = model(_inputs(9)), converted(_inputs(9))
    sqnr = 10 * torch.log10(float_out.pow(2).mean() / (float_out - quantized).pow(2).mean())
    assert sqnr > 25, sqnr
