"""Suite-wide settings: the reference models in tests are tiny, where one intra-op thread is fastest."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
