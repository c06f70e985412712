"""A tanh GELU written as arithmetic becomes one ``gelu(x, approximate="tanh")`` (coreai_opt.passes.recompose_gelu)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from coreai_opt.config import QuantizerConfig
from coreai_opt.passes.capture import capture
from coreai_opt.passes.recompose_gelu import recompose_gelu

W8A8 = QuantizerConfig.presets.w8a8


def _new_gelu(h: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (GPT-2, GPT-Neo, Phi, ALBERT)."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def _bloom_gelu(h: torch.Tensor) -> torch.Tensor:
    """BLOOM's ``bloom_gelu_forward``: the same function, factored and with a rounded constant."""
    return h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))


def _near_miss(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.05 * torch.pow(h, 3.0))))


class _Mlp(nn.Module):
    """``b(act(a(x)))``, optionally plus a residual read of ``a``'s output (``x`` read outside the chain)."""

    def __init__(self, act, residual: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.act, self.residual = nn.Linear(16, 32), nn.Linear(32, 32), act, residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(self.act(h))
        return y + h if self.residual else y


class _LeakyMlp(_Mlp):
    """GPT-Neo's GELU whose tanh value is also read outside the chain: replacing the chain would lose it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))
        return self.b(0.5 * h * (1.0 + t)) + t


def _functions(gm: torch.fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize(("act", "residual"), [(_new_gelu, False), (_bloom_gelu, True)])
def test_each_written_tanh_gelu_becomes_one_gelu_with_the_same_output(act, residual: bool, method: str) -> None:
    torch.manual_seed(0)
    model, x = _Mlp(act, residual).eval(), torch.randn(2, 5, 16) * 3
    gm = capture(model, (x,), method=method)
    assert recompose_gelu(gm, W8A8().resolve).changes == 1
    gelus = [n for n in gm.graph.nodes if "gelu" in str(n.target)]
    assert len(gelus) == 1 and gelus[0].kwargs == {"approximate": "tanh"}
    assert not any("tanh" in name or "pow" in name or "mul" in name for name in _functions(gm))
    with torch.no_grad():
        # float32 rounding of another order of the same arithmetic (BLOOM's 0.79788456 is 1e-9 off sqrt(2/pi))
        assert (gm(x) - model(x)).abs().max() < 2e-6


@pytest.mark.parametrize("model", [_Mlp(_near_miss), _LeakyMlp(_new_gelu), _Mlp(torch.tanh)],
                         ids=["constant 0.05", "tanh read outside", "plain tanh"])
def test_a_chain_that_is_not_exactly_gelu_or_is_read_inside_stays_as_written(model: nn.Module) -> None:
    torch.manual_seed(0)
    model, x = model.eval(), torch.randn(2, 5, 16)
    gm = capture(model, (x,), method="fx")
    before = _functions(gm)
    assert recompose_gelu(gm, W8A8().resolve).changes == 0
    assert _functions(gm) == before


@pytest.mark.parametrize("kind", ["tanh", "mul", "add"])
def test_a_config_naming_an_op_kind_of_the_chain_keeps_it_as_written(kind: str) -> None:
    model, x = _Mlp(_new_gelu).eval(), torch.randn(2, 5, 16)
    gm = capture(model, (x,), method="fx")
    config = W8A8().set_op_kind(kind, {"activation": W8A8().activation})
    assert recompose_gelu(gm, config.resolve).changes == 0
    assert recompose_gelu(gm, W8A8().resolve).changes == 1
