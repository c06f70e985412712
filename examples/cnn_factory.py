"""A timm-style CNN handed to the command line as a factory file: the shape of file a user writes for their model.

Quantize it (random calibration data; use --calib-data images.npz for real accuracy)::

    coreai-opt quantize examples/cnn_factory.py:make_model --input-shape 1,3,64,64

``coreai-opt`` imports this file (its folder on sys.path, like ``python examples/cnn_factory.py`` would) and calls
``make_model()``, which must return the float ``nn.Module``. For a timm or torchvision model the factory would be
``return timm.create_model("resnet18", pretrained=False).eval()`` plus a ``load_state_dict`` of your weights.

Run as a script, it prints the number of parameters and the output shape for one 64x64 image.
"""

from __future__ import annotations

import torch
from torch import nn

from coreai_opt.reference_models import resnet18_style

SEED = 0
NUM_CLASSES = 10
WIDTH = 16  # a quarter of ResNet-18's 64 base channels: the same graph, 16x fewer weights


def make_model() -> nn.Module:
    """ResNet-18-style network (BasicBlocks, BatchNorm, residual adds, global average pool), eval mode."""
    torch.manual_seed(SEED)
    return resnet18_style(num_classes=NUM_CLASSES, width=WIDTH).eval()


if __name__ == "__main__":
    model = make_model()
    with torch.no_grad():
        logits = model(torch.zeros(1, 3, 64, 64))
    print(f"{sum(p.numel() for p in model.parameters())} parameters; output shape {tuple(logits.shape)}")
