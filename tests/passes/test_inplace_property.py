"""Property: for random small graphs full of in-place ops, quantization is the only thing prepare/convert change.

Each example is a module built from a small op vocabulary: convolutions (some followed by BatchNorm), residual
``add_``, ``+=``, ``relu(inplace=True)`` (functional and ``nn.ReLU(inplace=True)``), ``mul_`` by a scalar,
out-of-place add/relu, a second name for a tensor and (rarely) a view that is written through. Every value any op
produced is returned, so a lost write shows up. For each example:

* prepared, observers and fake quantization off  ==  float model, bit for bit (``torch.equal``);
* converted  ==  prepared with fake quantization on (after calibration), bit for bit.

BatchNorm folding is off (``fold_batchnorm=False``): folding rounds differently from a separate BatchNorm, so
"bit for bit" would not hold for reasons that have nothing to do with in-place ops (the folded case is checked
within 1e-5 in tests/reliability/test_inplace_models.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import coreai_opt as co

CHANNELS = 3
OPS = ("conv", "conv_bn", "add_", "iadd", "relu_module", "relu_function", "mul_", "add", "relu", "alias", "view_write")


class _RandomNet(nn.Module):
    """Runs ``program``: a list of ``(op, a, b, scale)``; ``a``/``b`` pick operands among the values so far."""

    def __init__(self, program: list[tuple[str, int, int, float]]) -> None:
        super().__init__()
        self.program = program
        self.convs = nn.ModuleList(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1) for _ in program)
        self.norms = nn.ModuleList(nn.BatchNorm2d(CHANNELS) for _ in program)
        self.relus = nn.ModuleList(nn.ReLU(inplace=True) for _ in program)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x * 1.0]  # the model's input itself is not written (a quantized model never writes its inputs)
        for i, (op, a, b, scale) in enumerate(self.program):
            first, second = values[a % len(values)], values[b % len(values)]
            if op == "conv":
                values.append(self.convs[i](first))
            elif op == "conv_bn":
                values.append(self.norms[i](self.convs[i](first)))
            elif op == "add_":
                first.add_(second)
            elif op == "iadd":
                first += second
            elif op == "relu_module":
                self.relus[i](first)
            elif op == "relu_function":
                F.relu(first, inplace=True)
            elif op == "mul_":
                first.mul_(scale)
            elif op == "add":
                values.append(first + second)
            elif op == "relu":
                values.append(torch.relu(first))
            elif op == "alias":
                values.append(first)  # the same tensor under a second name
            else:  # view_write: a write through a view; FX refuses it and capture falls back to torch.export
                first[:, :1].mul_(scale)
        return torch.cat(values, dim=1)


def _model(program: list[tuple[str, int, int, float]], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = _RandomNet(program)
    with torch.no_grad():
        for norm in model.norms:
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.uniform_(0.5, 1.5)
    return model.eval()


_steps = st.tuples(
    st.sampled_from(OPS).filter(lambda op: op != "view_write") | st.just("view_write"),
    st.integers(0, 7),
    st.integers(0, 7),
    st.sampled_from([0.5, 2.0, -1.5]),
)
_CONFIG = co.QuantizerConfig.presets.w8a8().model_copy(update={"fold_batchnorm": False})


@settings(max_examples=15, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=st.lists(_steps, min_size=2, max_size=7), seed=st.integers(0, 2**16))
def test_prepare_changes_nothing_but_quantization_and_convert_changes_nothing_at_all(
    program: list[tuple[str, int, int, float]], seed: int
) -> None:
    model = _model(program, seed)
    generator = torch.Generator().manual_seed(seed)
    data = [torch.randn(2, CHANNELS, 5, 5, generator=generator) for _ in range(3)]
    reference = copy.deepcopy(model)
    prepared = co.prepare(model, _CONFIG, (data[0],))
    with torch.no_grad():
        co.enable_fake_quant(prepared, False)
        for x in data:
            assert torch.equal(prepared(x.clone()), reference(x.clone())), prepared.code
        co.enable_fake_quant(prepared, True)
        co.calibrate(prepared, data, progress=False)
        converted = co.convert(prepared)
        for x in data:
            assert torch.equal(converted(x.clone()), prepared(x.clone())), converted.code
