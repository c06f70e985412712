"""The test zoo: tiny instances of every reference architecture with example inputs.

Each entry builds a fresh, seeded model in eval mode (BatchNorm statistics randomised so that folding is
not a no-op) and returns example inputs and calibration batches of the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from coreai_opt import reference_models as rm
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["ZooEntry", "ZOO", "build", "randomize_batchnorm"]


@dataclass(frozen=True)
class ZooEntry:
    """How to build one zoo model and its inputs."""

    name: str
    factory: Callable[[], nn.Module]
    make_input: Callable[[int], torch.Tensor]
    capture: str  # the capture "auto" must pick
    is_cnn: bool


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32)


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("resnet18", lambda: rm.resnet18_style(10, width=8), _images, "fx", True),
        ZooEntry("mobilenet_v2", lambda: rm.mobilenet_v2_style(10, 0.25), _images, "fx", True),
        ZooEntry("conv_transpose_decoder", lambda: rm.ConvTransposeDecoder(3, 8, 3), _images, "fx", True),
        ZooEntry("transformer_encoder", lambda: rm.transformer_encoder(dim=32, depth=2, heads=4, vocab_size=100,
                                                                       max_len=16),
                 lambda b: torch.randint(0, 100, (b, 12)), "fx", False),
        ZooEntry("torch_transformer", lambda: rm.TorchTransformerClassifier(dim=32, heads=4, depth=2),
                 lambda b: torch.randn(b, 8, 32), "export", False),
        ZooEntry("shape_unpack", lambda: rm.ShapeUnpackModel(dim=16), lambda b: torch.randn(b, 8, 16), "export",
                 False),
        ZooEntry("conv1d_groupnorm", lambda: rm.Conv1dGroupNorm(4, 16, 10, 4), lambda b: torch.randn(b, 4, 32), "fx",
                 True),
    )
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Return ``(model in eval mode, example_inputs, 4 calibration batches)`` for a zoo entry."""
    entry = ZOO[name]
    torch.manual_seed(seed)
    model = randomize_batchnorm(entry.factory(), seed).eval()
    example = (entry.make_input(2),)
    batches = [entry.make_input(8) for _ in range(4)]
    return model, example, batches


PRESETS: tuple[str, ...] = ("w8", "w4", "w8a8", "w8a8_sym", "w4a8", "w8a16", "fp8")
BLOCK_SIZE = 8


def preset_config(preset: str, model: nn.Module):  # noqa: ANN201 (QuantizerConfig; imported lazily)
    """Build a preset for ``model``; per-block presets get per-channel overrides where blocks cannot fit.

    The zoo is tiny (3-channel stems, depthwise convs with one input channel per group), so the per-block
    presets use ``block_size=8`` and, exactly as the prepare error message suggests, a ``module_name`` override
    with per-channel int4 weights for each layer whose input-channel count 8 does not divide.
    """
    import re

    from coreai_opt.config import QuantizerConfig
    from coreai_opt.config.quantizer_config import OpConfig
    from coreai_opt.quantization.spec import PerChannel, QuantizationSpec

    if preset not in ("w4", "w4a8"):
        return getattr(QuantizerConfig.presets, preset)()
    cfg = getattr(QuantizerConfig.presets, preset)(block_size=BLOCK_SIZE)
    per_channel = QuantizationSpec(dtype="int4", granularity=PerChannel(0))
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear, nn.ConvTranspose2d)):
            in_channels = m.weight.shape[0] if isinstance(m, nn.ConvTranspose2d) else m.weight.shape[1]
            if in_channels % BLOCK_SIZE:
                cfg.set_module_name(re.escape(name), OpConfig(weight=per_channel))
    return cfg


def weighted_layer_count(model: nn.Module) -> int:
    """Number of weights the presets quantize: conv/linear/embedding modules plus MHA input projections."""
    layers = (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d, nn.Linear, nn.Embedding)
    return sum(isinstance(m, layers) for m in model.modules()) + sum(
        name.endswith("in_proj_weight") for name, _ in model.named_parameters())
