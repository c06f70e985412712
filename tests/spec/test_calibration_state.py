"""The export lifts only the qparams a converted quantizer reads; the model's calibration state comes back intact.

Also the derived int32 bias scales: frozen for the export (one tensor per bias, not arithmetic between two quantizers'
qparams), the same values, and gone afterwards.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.export import export_onnx as export_module
from coreai_opt.onnx.export.frozen_bias_scales import bias_scales_frozen
from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
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
            assert not any(k.startswith(f"{_path(model, quantizer)}.") and k.endswith("_enabled") for k in inside)
            assert quantizer.has_qparams and bool(quantizer.fake_quant_enabled)  # still readable as attributes
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


def test_frozen_bias_scales_are_the_derived_products_and_leave_no_trace() -> None:
    model = _converted("minmax")
    biases = [m for m in model.modules() if isinstance(m, BiasFakeQuantize)]
    example = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        reference = model(example)
    before = list(model.state_dict(keep_vars=True))
    with bias_scales_frozen(model) as frozen, torch.no_grad():
        assert frozen == len(biases) == 2
        conv_bias = biases[0]
        assert torch.equal(conv_bias.scale, _derived_scale(model, conv_bias))
        assert conv_bias.zero_point.dtype == torch.int32 and not conv_bias.zero_point.any()
        assert list(model.state_dict(keep_vars=True)) == before  # non-persistent: not part of the state
        assert torch.equal(model(example), reference)
    assert all("scale" not in m._buffers and not hasattr(m, "scale") for m in biases)
    assert list(model.state_dict(keep_vars=True)) == before


def _derived_scale(model: nn.Module, bias_quantizer: BiasFakeQuantize) -> torch.Tensor:
    """``s_in · s_w`` of the layer ``bias_quantizer`` serves, read from the graph's call."""
    name = _path(model, bias_quantizer)
    node = next(n for n in model.graph.nodes if n.op == "call_module" and n.target == name)
    s_in, s_w = (model.get_submodule(str(a.target)).get_qparams().scale for a in node.args[1:])
    return s_in.reshape(()) * s_w
