"""Per-rank scenario of the distributed GPTQ test (module-level so spawned ranks can import it).

The model reads integer-valued inputs with two linears, so every sum of the input statistics (``Σ xᵀx``, ``Σ x²``,
``Σ |x|``, the row count) is exact in float32 whatever the order of the additions: merged statistics, and hence the
GPTQ integers, must be bit-identical to single-process calibration.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import coreai_opt as co
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.spec import PerBlock, QuantizationSpec


class TwoHeads(nn.Module):
    """``fc_a(x) + fc_b(x)``: both linears read the (integer-valued) model input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc_a = nn.Linear(64, 48)
        self.fc_b = nn.Linear(64, 48)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_a(x) + self.fc_b(x)


def make_batches(num_batches: int) -> list[Tensor]:
    """Correlated integer-valued inputs ``(4, 64)`` in [-8, 8]."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(-2, 3, (num_batches, 4, 8), generator=gen).float()
    return [torch.cat([b.repeat(1, 4), torch.randint(-8, 9, (4, 32), generator=gen).float()], dim=1) for b in base]


def gptq_config() -> QuantizerConfig:
    spec = QuantizationSpec(dtype="int4", granularity=PerBlock(axis=1, block_size=32), weight_rounding="gptq")
    return QuantizerConfig(weight=spec, activation=None, int32_bias=False)


def calibrated_roundings(batches: list[Tensor]) -> dict[str, list[list[int]]]:
    """Calibrate a fresh prepared TwoHeads on ``batches``; the GPTQ integers of each weight quantizer."""
    prepared = co.prepare(TwoHeads().eval(), gptq_config(), (make_batches(1)[0],))
    co.calibrate(prepared, batches, progress=False)
    return {name: fq.rounding.qweight.tolist() for name, fq in prepared.named_modules()
            if isinstance(fq, co.quantization.spec.FakeQuantize)}


def gptq_scenario(rank: int, world: int, shards: list[int]) -> dict[str, list[list[int]]]:
    """Calibrate on this rank's shard (``sync="auto"`` merges the statistics) and return the integers."""
    batches = make_batches(sum(shards))
    start = sum(shards[:rank])
    return calibrated_roundings(batches[start : start + shards[rank]])
