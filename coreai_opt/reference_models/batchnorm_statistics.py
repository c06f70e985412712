"""Non-trivial BatchNorm statistics for freshly built reference models, so that folding BatchNorm matters."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["randomize_batchnorm"]


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters (in place), so folding matters.

    Freshly built models have mean 0, variance 1, weight 1 and bias 0, for which folding is nearly the identity.
    """
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.75)
                    m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model
