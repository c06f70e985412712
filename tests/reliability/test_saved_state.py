"""Saved calibration state: ``torch.save(prepared.state_dict())`` after calibration loads, with ``strict=True`` and
before any forward, into a freshly prepared model of the same config, and reproduces the converted model and the
ONNX file bit for bit. A state_dict from a different config does not load silently when its quantizer set differs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import OpConfig

from .conftest import Pipeline, make_small_cnn


def _saved(prepared: torch.fx.GraphModule, path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    torch.save(prepared.state_dict(), path)
    return torch.load(path, weights_only=True)


def test_calibrated_state_reloads_into_a_fresh_prepare_and_reproduces_outputs_and_onnx_bytes(
    cnn_pipeline: Pipeline, tmp_path  # noqa: ANN001
) -> None:
    state = _saved(cnn_pipeline.prepared, tmp_path / "calibrated.pt")
    # Different initial weights: everything that matters must come from the state_dict.
    fresh = co.prepare(make_small_cnn(seed=123), co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    assert not all(fq.calculator.has_qparams for _, fq in fake_quantizers(fresh))
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), (_, b) in zip(fake_quantizers(cnn_pipeline.prepared), fake_quantizers(fresh), strict=True):
        assert torch.equal(a.calculator.scale, b.calculator.scale), name
        if a.calculator.zero_point is not None:
            assert torch.equal(a.calculator.zero_point, b.calculator.zero_point), name
    converted = co.convert(fresh)
    for batch in cnn_pipeline.data:
        assert torch.equal(converted(batch), cnn_pipeline.converted(batch))
    path = co.export_onnx(converted, (cnn_pipeline.example,), tmp_path / "reloaded.onnx")
    assert path.read_bytes() == cnn_pipeline.onnx_path.read_bytes()


def test_histogram_and_per_block_state_reloads_bit_identically(tmp_path) -> None:  # noqa: ANN001
    """Percentile histograms and per-block int4 weight qparams round-trip too (buffers shaped by data)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = [torch.randn(4, 64) for _ in range(3)]
    config = co.QuantizerConfig.presets.w4a8(block_size=32, activation_range="percentile")
    prepared = co.prepare(model, config, (data[0],))
    co.calibrate(prepared, data, progress=False)
    fresh = co.prepare(model, config, (data[0],))
    fresh.load_state_dict(_saved(prepared, tmp_path / "s.pt"), strict=True)
    a, b = co.convert(prepared), co.convert(fresh)
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs)  # specs: dicts
    assert torch.equal(a(data[1]), b(data[1]))


def test_state_of_an_uncalibrated_model_reloads_as_uncalibrated(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    prepared = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    fresh = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    fresh.load_state_dict(_saved(prepared, tmp_path / "raw.pt"), strict=True)
    with pytest.raises(ValueError, match=r"activation quantizer\(s\) were never calibrated: .*fc\.output"):
        co.convert(fresh)


def test_state_from_a_config_with_other_quantizers_fails_listing_them(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    state = _saved(cnn_pipeline.prepared, tmp_path / "calibrated.pt")
    config = co.QuantizerConfig.presets.w8a8().set_module_name("fc", OpConfig(activation=None))
    other = co.prepare(cnn_pipeline.model, config, (cnn_pipeline.example,))
    unexpected = r"Unexpected key\(s\) in state_dict: \"fc_output_fq\.observer_enabled\""
    with pytest.raises(RuntimeError, match=unexpected) as e:
        other.load_state_dict(state, strict=True)
    assert "fc_output_fq.calculator.scale" in str(e.value)
    missing = {k: v for k, v in state.items() if not k.startswith("x_input_fq.")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"x_input_fq\.observer_enabled\""):
        co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,)).load_state_dict(
            missing, strict=True)
