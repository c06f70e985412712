"""The in-place repro models of the hostile-user probe: prepare/convert must not change what they compute.

Measured before the fix: conv -> BN -> ``add_`` under FX was off by a relative error of 0.84 already in the
prepared model (dead-code elimination deleted the ``add_``), the converted ``x.mul_(s)`` model by 0.42.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coreai_opt as co

CAPTURES = ("fx", "export")


class ConvBNAddInplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        y.add_(x)
        return y


class ReluInplaceResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        self.relu(y)
        out = y + x
        F.relu(out, inplace=True)
        return out


class MulInplaceScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y.mul_(0.5)
        return torch.relu(y)


MODELS = {"conv_bn_add_": ConvBNAddInplace, "relu_inplace_residual": ReluInplaceResidual,
          "mul_scalar_": MulInplaceScalar}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    if isinstance(model, ConvBNAddInplace):
        with torch.no_grad():
            model.bn.running_mean.uniform_(-0.5, 0.5)
            model.bn.running_var.uniform_(0.5, 2.0)
            model.bn.weight.uniform_(0.5, 1.5)
    return model.eval()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("method", CAPTURES)
@pytest.mark.parametrize("name", list(MODELS))
def test_prepared_with_quantization_off_equals_float_and_converted_equals_prepared(name: str, method: str) -> None:
    model, data = _build(name), _batches()
    config = co.QuantizerConfig.presets.w8a8().model_copy(update={"fold_batchnorm": False})
    prepared = co.prepare(model, config, (data[0],), capture=method)
    with torch.no_grad():
        co.enable_fake_quant(prepared, False)
        assert all(torch.equal(prepared(x.clone()), copy.deepcopy(model)(x.clone())) for x in data)
        co.enable_fake_quant(prepared, True)
        co.calibrate(prepared, data, progress=False)
        converted = co.convert(prepared)
        assert all(torch.equal(converted(x.clone()), prepared(x.clone())) for x in data)


@pytest.mark.parametrize("method", CAPTURES)
def test_with_batchnorm_folding_the_quantization_off_model_is_within_float_rounding(method: str) -> None:
    model, data = _build("conv_bn_add_"), _batches()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],), capture=method)
    co.enable_fake_quant(prepared, False)
    with torch.no_grad():
        for x in data:
            expected = model(x.clone())
            error = (prepared(x.clone()) - expected).abs().max() / expected.abs().max()
            assert error < 1e-6, f"relative error {error:.2e} (0.84 when the add_ was deleted)"


@pytest.mark.parametrize("method", CAPTURES)
@pytest.mark.parametrize("name", list(MODELS))
def test_the_quantized_model_tracks_the_float_model(name: str, method: str) -> None:
    model, data = _build(name), _batches()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],), capture=method)
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    with torch.no_grad():
        for x in data:
            expected = model(x.clone())
            error = float((converted(x.clone()) - expected).norm() / expected.norm())
            assert error < 0.03, f"relative error {error:.3f} (0.42-0.84 when in-place ops were lost)"
