"""A boolean-mask selection exports and runs in onnxruntime, also for a batch whose mask selects nothing (issue 30)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from coreai_opt.api import calibrate, convert, prepare
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx


class _MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[mask])


def test_masked_head_verifies_in_onnxruntime_with_an_empty_selection_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    some, none = torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)
    some[0, 1] = some[1, 3] = True
    prepared = prepare(_MaskedHead().eval(), QuantizerConfig.presets.w8a8(), (x, some))
    calibrate(prepared, [(x, some), (x, none)], progress=False)
    converted = convert(prepared)
    path = tmp_path / "masked.onnx"
    export_onnx(converted, (x, some), path)
    report = verify_onnx(converted, path, [(x, some), (x, none)])
    assert report.ok, report
    assert converted(x, none).shape == (0, 3)
