"""``batchnorm_statistics_from_data``: statistics measured on the data, so a small-init model still sees its input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coreai_opt.reference_models import batchnorm_statistics_from_data, randomize_batchnorm


def _small_init_stack(depth: int) -> nn.Sequential:
    """Conv → BatchNorm → SiLU blocks with weights from N(0, 0.02²), as ``transformers`` initialises them."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        conv = nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1, bias=False)
        nn.init.normal_(conv.weight, std=0.02)
        layers += [conv, nn.BatchNorm2d(16), nn.SiLU()]
    return nn.Sequential(*layers)


def _input_dependence(model: nn.Module, x: torch.Tensor) -> float:
    """Across-sample std of the output, over its overall std (0: the output is the same for every input)."""
    with torch.no_grad():
        y = model(x).flatten(1).double()
    return float(y.std(0).mean() / y.std())


def test_each_batchnorm_maps_the_data_to_its_weight_and_bias_per_channel():
    model = _small_init_stack(2)
    x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    batchnorm_statistics_from_data(model, [(x,)])
    seen: list[tuple[torch.Tensor, nn.BatchNorm2d]] = []
    for m in model:
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_hook(lambda mod, _inputs, out: seen.append((out, mod)))
    with torch.no_grad():
        model(x)
    assert len(seen) == 2
    # the first BatchNorm sees in eval what it measured: one batch gives running_mean = E[x] and
    # running_var = Var_unbiased[x], so its output has mean = bias and biased variance
    # weight² (n - 1) / n · var / (var + eps) per channel
    out, bn = seen[0]
    per_channel = out.transpose(0, 1).flatten(1).double()
    n, var = per_channel.shape[1], bn.running_var.double()
    expected_std = bn.weight.double().abs() * torch.sqrt((n - 1) / n * var / (var + bn.eps))
    torch.testing.assert_close(per_channel.mean(1), bn.bias.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_channel.std(1, unbiased=False), expected_std, atol=1e-5, rtol=1e-4)
    # the second measured its input behind the first's train-mode (biased-variance) normalisation: within 0.1 %
    out, bn = seen[1]
    per_channel = out.transpose(0, 1).flatten(1).double()
    torch.testing.assert_close(per_channel.mean(1), bn.bias.double(), atol=2e-3, rtol=0)
    torch.testing.assert_close(per_channel.std(1, unbiased=False), bn.weight.double().abs(), atol=0, rtol=2e-3)


def test_a_small_init_model_output_depends_on_its_input_again():
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    fixed = randomize_batchnorm(_small_init_stack(5)).eval()
    assert _input_dependence(fixed, x) < 1e-3  # measured 2.7e-4: fixed-size statistics swamp a ~0.02 signal
    measured = batchnorm_statistics_from_data(_small_init_stack(5), [(x[:8],), (x[8:],)])
    assert _input_dependence(measured, x) > 0.5  # measured 0.88


def test_the_model_comes_back_in_eval_mode_with_its_momentum():
    model = _small_init_stack(1)
    model[1].momentum = 0.3
    batchnorm_statistics_from_data(model.train(), [(torch.randn(4, 3, 8, 8),)])
    assert not model.training and model[1].momentum == pytest.approx(0.3)
    assert int(model[1].num_batches_tracked) == 1
