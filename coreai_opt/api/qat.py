"""Quantization-aware training helpers: switch observers and fake quantization of a prepared model.

A model from ``prepare(..., qat=True)`` trains with straight-through gradients (the custom op passes the
gradient where the input was not clamped). A usual schedule: ``calibrate`` first, train with observers on,
then ``enable_observers(model, False)`` for the last epochs to freeze the ranges, then ``convert``.
"""

from __future__ import annotations

from torch import nn

from coreai_opt.api.internals.quantizer_state import bias_quantizers, fake_quantizers
from coreai_opt.error_boundary import public_api

__all__ = ["enable_observers", "enable_fake_quant"]


def _quantizers(model: nn.Module, caller: str) -> list:
    found = fake_quantizers(model)
    if not found:
        raise ValueError(f"{caller}: {type(model).__name__} has no quantizers; pass a model returned by prepare")
    frozen = [fq.name for _, fq in found if fq.export_mode]
    if frozen:
        raise ValueError(
            f"{caller}: the model is converted (quantizers frozen, e.g. {frozen[0]}); use the prepared model"
        )
    return [fq for _, fq in found]


@public_api
def enable_observers(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch statistics collection of every quantizer on or off; returns ``model``."""
    for fq in _quantizers(model, "enable_observers"):
        fq.enable_observer(enabled)
    return model


@public_api
def enable_fake_quant(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch fake quantization of every quantizer (int32 bias quantizers too) on or off; returns ``model``.

    Off gives the float model.
    """
    for fq in _quantizers(model, "enable_fake_quant"):
        fq.enable_fake_quant(enabled)
    for _, bq in bias_quantizers(model):
        bq.enable_fake_quant(enabled)
    return model
