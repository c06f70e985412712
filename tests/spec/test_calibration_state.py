"""The export lifts only the qparams a converted quantizer reads; the model's calibration state comes back intact."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.export import export_onnx as export_module
from coreai_opt.quantization.fake_quantize.calibration_state import EXPORTED_QPARAMS, calibration_state_hidden
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize


def _converted(range_calculator: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    config = co.QuantizerConfig.presets.w8a8(activation_range=range_calculator)
    example = torch.randn(2, 3, 8, 8)
    prepared = co.prepare(model, config, (example,))
    co.calibrate(prepared, [torch.randn(2, 3, 8, 8) for _ in range(3)])
    return co.convert(prepared)


@pytest.mark.parametrize("range_calculator", ["minmax", "percentile"])
def test_hiding_leaves_only_the_read_qparams_and_restores_the_same_tensors_in_order(range_calculator: str) -> None:
    model = _converted(range_calculator)
    before = list(model.state_dict(keep_vars=True).items())
    with calibration_state_hidden(model) as hidden:
        inside = model.state_dict(keep_vars=True)
        for quantizer in (m for m in model.modules() if isinstance(m, FakeQuantize) and m.export_mode):
            calculator_keys = {k for k in inside if k.startswith(f"{_path(model, quantizer.calculator)}.")}
            assert {k.rsplit(".", 1)[-1] for k in calculator_keys} <= EXPORTED_QPARAMS
    assert hidden > 0 and len(inside) == len(before) - hidden
    after = list(model.state_dict(keep_vars=True).items())
    assert [k for k, _ in after] == [k for k, _ in before]
    # the same tensor objects; ``_extra_state`` (the quantizer's spec) is rebuilt on every state_dict call
    assert all(a is b if isinstance(a, torch.Tensor) else a == b for (_, a), (_, b) in zip(after, before, strict=True))


def test_hidden_state_comes_back_when_the_export_fails() -> None:
    model = _converted("percentile")
    before = list(model.state_dict(keep_vars=True))
    with pytest.raises(RuntimeError, match="export failed"), calibration_state_hidden(model):
        raise RuntimeError("export failed")
    assert list(model.state_dict(keep_vars=True)) == before


def test_the_file_is_byte_identical_to_an_export_that_lifts_every_buffer(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = _converted("percentile")
    example = (torch.randn(1, 3, 8, 8),)
    hidden = co.export_onnx(model, example, tmp_path / "hidden.onnx").read_bytes()
    monkeypatch.setattr(export_module, "calibration_state_hidden", lambda _model: contextlib.nullcontext(0))
    lifted = co.export_onnx(model, example, tmp_path / "lifted.onnx").read_bytes()
    assert hidden == lifted


def _path(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)
