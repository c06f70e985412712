"""Suite-wide settings: the reference models in tests are tiny, where one intra-op thread is fastest.

transformers and timm import torchvision, whose CUDA-only wheel cannot load its C++ ops beside the CPU torch;
declaring the two op schemas it needs first lets both import (see benchmarks/torchvision_ops.py).
"""

from __future__ import annotations

import torch

from benchmarks.torchvision_ops import declare_torchvision_ops

torch.set_num_threads(1)
declare_torchvision_ops()
