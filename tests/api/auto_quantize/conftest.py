import json

import pytest
import torch
from torch import nn

from coreai_opt.api.algorithms.auto_quantize import KERNEL_KINDS, CostTable, KernelCost
from coreai_opt.api.algorithms.auto_quantize import cost_measurement as cm

#: Hand-written cost lines (overhead µs, MACs per µs): static fastest, then dynamic, then int8_compute; int16 beats
#: float on overhead only (as on a runtime with 16-bit kernels), so every candidate is measured.
LINES = {"float": (1.0, 100.0), "dynamic": (3.0, 300.0), "static": (2.0, 400.0), "int16": (0.5, 90.0),
         "int8_compute": (2.5, 200.0)}

#: Cost lines (overhead µs, MACs per µs) measured on the development machine (1 onnxruntime thread), rounded.
MEASURED = {"linear_float": (1.0, 71_000.0), "linear_dynamic": (12.0, 470_000.0), "linear_static": (19.0, 375_000.0),
            "linear_int16": (1.0, 30_000.0), "conv_float": (37.0, 83_000.0), "conv_static": (22.0, 245_000.0),
            "conv_int16": (60.0, 48_000.0),
            # not measured on the quiet development machine: float's throughput x 1.01 and its overhead + 15 µs, the
            # ratios of a measurement under load (2026-12-01; MatMulNBits int8 compute at 48 tokens is no faster
            # than float on this CPU)
            "linear_int8_compute": (16.0, 72_000.0)}


def table(lines: dict[str, tuple[float, float]] = LINES, key: str = "test") -> CostTable:
    """One line per format (``"static"``) or per kernel kind (``"conv_static"``) when given."""
    return CostTable({k: KernelCost(*lines.get(k, lines.get(k.split("_", 1)[1]))) for k in KERNEL_KINDS}, key)


def plant_cost_table(folder):
    """Write the development machine's rounded table as this machine's cache file: the choices do not depend on
    a measurement taken under load (measuring and caching are tested in tests/api/auto_quantize)."""
    path = cm.cache_path(1, folder)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table(MEASURED, key=cm.machine_key(1)).to_dict()))
    return path


class TinyBlock(nn.Module):
    """LayerNorm (one 20x outlier channel) read by q and k, a gated residual, then fc1 -> GELU -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            self.ln.weight[3] = 20.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        h = h + self.q(h) * torch.sigmoid(self.k(h))
        return self.fc2(self.act(self.fc1(h)))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = TinyBlock().eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 6, 16, generator=generator) for _ in range(8)]
    return model, batches
