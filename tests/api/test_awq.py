"""Activation-aware weight scaling (``co.awq``): exact scales, a smaller 4-bit output error than plain rounding on
a layer with loud activation channels, unchanged float outputs, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.algorithms.awq import awq_scale
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.spec import PerBlock, QuantizationSpec


class _Block(nn.Module):
    """LayerNorm -> fc1 -> GELU -> fc2: a foldable site (the LayerNorm) and a non-foldable one (the GELU)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _Block().eval()
    with torch.no_grad():  # loud channels after the LayerNorm, as in real transformers (outlier features)
        model.norm.weight[:4] = 30.0
    return model


def _data(n: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, 64, generator=gen) for _ in range(n)]


def _w4_rtn() -> QuantizerConfig:
    return QuantizerConfig.presets.w4(algorithm="rtn")


def _quantized_error(model: nn.Module, data: list[torch.Tensor], reference: nn.Module) -> float:
    prepared = co.prepare(model, _w4_rtn(), (data[0],), capture="export")
    co.calibrate(prepared, data[:2], progress=False)
    converted = co.convert(prepared)
    held_out = torch.cat(data[4:])
    with torch.no_grad():
        ref = reference(held_out)
        return float((converted(held_out) - ref).pow(2).mean() / ref.pow(2).mean())


def test_awq_scale_is_the_normalised_power_of_the_mean_abs_with_ones_for_silent_channels():
    s = awq_scale(torch.tensor([1.0, 4.0, 0.0]), 0.5)  # m^α = [1, 2], sqrt(max·min) = sqrt(2)
    torch.testing.assert_close(s, torch.tensor([1 / math.sqrt(2), math.sqrt(2), 1.0]))
    assert torch.equal(awq_scale(torch.tensor([1.0, 4.0]), 0.0), torch.ones(2))


def test_awq_lowers_the_4bit_output_error_below_plain_rounding_on_loud_channels():
    model, data = _model(), _data()
    before = _quantized_error(model, data, model)
    result = co.awq(model, data[:4], (data[0],), weight=_w4_rtn().weight)
    after = _quantized_error(result.model, data, model)
    chosen = {r.site.kind: r.alpha for r in result.sites}
    assert chosen["layer_norm"] is not None and chosen["layer_norm"] > 0
    assert all(r.error_after <= r.error_before for r in result.sites)
    norm_site = next(r for r in result.sites if r.site.kind == "layer_norm")
    # measured: fc1's relative error 0.00403 -> 0.0021 at alpha 0.3; the whole block's held-out relative MSE
    # 0.00834 -> 0.00635 (rtn int4, blocks of 32, asymmetric)
    assert norm_site.error_after < 0.6 * norm_site.error_before, norm_site
    assert after < 0.8 * before, (before, after)


def test_awq_keeps_float_outputs_and_leaves_the_user_model_untouched():
    model, data = _model(), _data()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = co.awq(model, data[:4], (data[0],))
    with torch.no_grad():
        torch.testing.assert_close(result.model(data[5]), model(data[5]), rtol=1e-4, atol=1e-4)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_awq_inserts_a_mul_only_for_non_foldable_sites_when_asked():
    model, data = _model(), _data()
    with_mul = co.awq(model, data[:4], (data[0],), insert_mul=True)
    without = co.awq(model, data[:4], (data[0],), insert_mul=False)
    gelu_site = [r for r in without.sites if r.site.kind == "mul"]
    assert gelu_site and gelu_site[0].alpha is None  # not foldable, no Mul allowed: left unscaled

    def muls(gm: torch.fx.GraphModule) -> int:
        return sum(n.op == "call_function" and "mul" in str(n.target) for n in gm.graph.nodes)

    scaled_gelu = [r for r in with_mul.sites if r.site.kind == "mul"][0].alpha is not None
    assert muls(with_mul.model) - muls(without.model) == int(scaled_gelu)
    assert "| `fc1` | layer_norm |" in with_mul.table()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"weight": QuantizationSpec(dtype="float8_e4m3fn")}, ValueError, "integer weights of at most 8 bits"),
    ({"weight": "w4"}, TypeError, "weight must be a QuantizationSpec"),
    ({"alphas": (0.5, 1.5)}, ValueError, "alphas must be a non-empty tuple of floats in"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be a positive int"),
])
def test_awq_rejects_bad_arguments_with_the_fix(kwargs, error, match):
    model, data = _model(), _data(2)
    with pytest.raises(error, match=match):
        co.awq(model, data, (data[0],), **kwargs)


def test_awq_rejects_empty_data():
    model, data = _model(), _data(1)
    with pytest.raises(ValueError, match="at least one calibration batch"):
        co.awq(model, [], (data[0],))


def test_awq_per_block_spec_falls_back_per_channel_where_the_block_does_not_divide():
    model, data = _model(), _data(2)
    spec = QuantizationSpec(dtype="int4", qscheme="asymmetric", granularity=PerBlock(axis=1, block_size=48))
    result = co.awq(model, data, (data[0],), weight=spec)  # 64 and 128 input channels: 48 divides neither
    assert len(result.sites) == 2
