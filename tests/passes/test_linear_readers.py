"""linear_readers / linear_weight: one answer to "which linears read X" for SmoothQuant and calibration search."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.api.algorithms.activation_stats import ChannelAbsMax, input_absmax
from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.linear_readers import linear_bias, linear_readers, linear_weight
from tests.passes.pipeline import inserted


class _Readers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3, bias=False)
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + F.linear(x, self.w * 2) + F.linear(x.relu(), self.w)


def test_linear_readers_lists_the_linears_with_a_constant_weight_reading_a_tensor() -> None:
    gm = fx.symbolic_trace(_Readers())
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert linear_readers(x, gm) == []  # call_module linears hide their weight; F.linear(x, w * 2) computes it
    gm = inserted(_Readers().eval(), torch.randn(2, 4), QuantizerConfig.presets.w8a8())
    quantized_x = next(iter(next(n for n in gm.graph.nodes if n.op == "placeholder").users))
    readers = linear_readers(quantized_x, gm)
    # functionalized a and b, looking through their weight quantizers (the computed-weight linear is left out)
    weights = {linear_weight(r, gm).target: r for r in readers}
    assert sorted(weights) == ["a.weight", "b.weight"]
    assert linear_bias(weights["a.weight"], gm).target == "a.bias" and linear_bias(weights["b.weight"], gm) is None


def test_channel_absmax_keeps_the_running_per_channel_maximum() -> None:
    stats = ChannelAbsMax()
    flat = stats.update("x", torch.tensor([[[1.0, -5.0], [-2.0, 0.5]]]))
    assert flat.shape == (2, 2)
    stats.update("x", torch.tensor([[3.0, 1.0]]))
    assert stats.values["x"].tolist() == [3.0, 5.0]
    model = nn.Sequential(nn.Linear(2, 2))
    batches = [torch.tensor([[1.0, -5.0], [-2.0, 0.5]]), torch.tensor([[3.0, 1.0]])]
    assert input_absmax(model, batches)["0"].tolist() == [3.0, 5.0]
