"""Softmax with quantized input and output: onnxruntime's integer QLinearSoftmax vs the eager model, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx


class _Scores(nn.Module):
    """``softmax(x @ W)`` over the last axis, followed by a linear (so the probabilities are quantized and used)."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.proj = nn.Linear(32, width)
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.softmax(self.proj(x) * 4.0, dim=-1))


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_sym"])
def test_quantized_softmax_matches_onnxruntime_qlinearsoftmax_exactly(tmp_path: Path, preset: str) -> None:
    """onnxruntime requantizes softmax with floor(1 / y_scale); a 2^-k output step makes that exact."""
    torch.manual_seed(0)
    model = _Scores().eval()
    batches = [(torch.randn(16, 6, 32),) for _ in range(4)]
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.get(preset)(), batches[0])
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    (softmax_fq,) = [m for n, m in converted.named_modules() if n == "softmax_output_fq"]
    expected_step = 2.0**-8 if preset == "w8a8" else 2.0**-7
    assert float(softmax_fq.calculator.scale) == expected_step
    path = export_onnx(converted, batches[0], tmp_path / "softmax.onnx")
    torch.manual_seed(1)
    report = verify_onnx(converted, path, [torch.randn(32, 6, 32) for _ in range(4)])
    print(report)
    if preset == "w8a8":  # onnxruntime fuses uint8 DQ -> Softmax -> Q into its integer kernel: bit for bit
        assert report.fusion.other_quantized.get("QLinearSoftmax") == 1
        assert report.outputs[0].max_diff_steps == 0.0, str(report)
    else:  # int8: onnxruntime runs a float Softmax between the QGemms (no QLinearSoftmax); its float result may sit an
        # ulp from torch's and flip one rounding tie of the next quantizer (measured: 1 step, with the narrowed
        # int8 weight grid; 0 before, by chance)
        assert report.fusion.other_quantized.get("QLinearSoftmax") is None
        assert report.outputs[0].max_diff_steps < 1.001 and report.ok, str(report)  # steps are float quotients
