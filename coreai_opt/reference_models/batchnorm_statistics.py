"""Non-trivial BatchNorm statistics for freshly built reference models, so that folding BatchNorm matters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["batchnorm_statistics_from_data", "randomize_batchnorm"]


def _batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]


def _draw_affine(m: nn.modules.batchnorm._BatchNorm, gen: torch.Generator) -> None:
    """Weight U(0.75, 1.25), bias 0.1 N(0, 1), when ``m`` has them (under ``torch.no_grad``)."""
    if m.affine:
        m.weight.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.75)
        m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters (in place), so folding matters.

    Freshly built models have mean 0, variance 1, weight 1 and bias 0, for which folding is nearly the identity.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in _batchnorms(model):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.5)
            _draw_affine(m, gen)
    return model


def batchnorm_statistics_from_data(model: nn.Module, batches: Iterable[tuple[torch.Tensor, ...]],
                                   seed: int = 0) -> nn.Module:
    """Set every BatchNorm's running statistics to those of its own input on ``batches`` (in place), as training does.

    :func:`randomize_batchnorm` draws statistics of a fixed size (mean ~0.1, variance 0.5-1). Behind convolutions
    initialised small (``transformers`` draws weights from N(0, 0.02²)) the signal is far smaller than that mean,
    so each BatchNorm hands on mostly its constant, and after a few blocks the model's output no longer depends on
    its input. Here the affine parameters are drawn as in :func:`randomize_batchnorm` (weight U(0.75, 1.25), bias
    0.1 N(0, 1)) and the statistics are measured, layer by layer in one train-mode pass per batch:

        running_mean = mean over batches of E[x],  running_var = mean over batches of Var_unbiased[x]

    (the cumulative average, ``momentum=None``), each layer seeing its predecessors already normalising. In eval
    mode every BatchNorm then maps its input on this data to about ``weight * N(0, 1) + bias`` per channel.
    Other modules run in train mode during the pass too (dropout included); no gradients are kept. The model is
    returned in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    norms = _batchnorms(model)
    momenta = [m.momentum for m in norms]
    with torch.no_grad():
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
            _draw_affine(m, gen)
        model.train()
        try:
            for batch in batches:
                model(*batch)
        finally:
            model.eval()
            for m, momentum in zip(norms, momenta, strict=True):
                m.momentum = momentum
    return model
