"""Full-flow scenarios (prepare -> calibrate -> convert -> export_onnx) for the distributed tests.

Shared by the ranks and by the parent process, which computes the single-process references with the same
model, data and configs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

import coreai_opt as co
from coreai_opt.config.quantizer_config import OpConfig
from coreai_opt.quantization.spec import FakeQuantize, MovingAverageQParamsCalculator

RANGES = ("minmax", "moving_average", "percentile", "mse", "entropy")
EXACT_RANGES = ("minmax", "percentile", "mse", "entropy")  # order-independent: sharding cannot change them
QPARAM_SUFFIXES = (".scale", ".zero_point", ".minval", ".running_min", ".running_max")
FEATURES = 16


def mlp() -> nn.Module:
    """Five linear layers, so that a mixed config can give each one a different activation range."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = FEATURES
    for i in range(5):
        out = 10 if i == 4 else 24
        layers += [nn.Linear(width, out)] + ([nn.ReLU()] if i < 4 else [])
        width = out
    return nn.Sequential(*layers).eval()


def api_batches(num_batches: int, seed: int = 1) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(num_batches):
        x = torch.randn(3 + i % 2, FEATURES, generator=gen) * (1.0 + 0.2 * i)
        x[0, i % FEATURES] = 6.0 + i  # outliers for the histogram calculators to clip
        batches.append(x)
    return batches


def example_inputs() -> tuple[Tensor]:
    return (torch.zeros(4, FEATURES),)


def mixed_config() -> co.QuantizerConfig:
    """w8a8 with a different order-independent activation range calculator on the first four linear layers."""
    config = co.QuantizerConfig.presets.w8a8()
    for i, activation_range in enumerate(EXACT_RANGES):
        activation = co.QuantizerConfig.presets.w8a8(activation_range=activation_range).activation
        config.set_module_name(str(2 * i), OpConfig(activation=activation))
    return config


def calibrated(config: co.QuantizerConfig, batches: list[Tensor], sync: str) -> torch.fx.GraphModule:
    prepared = co.prepare(mlp(), config, example_inputs())
    co.calibrate(prepared, batches, progress=False, sync=sync)
    return prepared


def qparams(model: nn.Module) -> dict[str, Tensor]:
    """Every scale / zero point / minval and running range buffer."""
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith(QPARAM_SUFFIXES)}


def shard(batches: list[Tensor], shards: list[int], rank: int) -> list[Tensor]:
    start = sum(shards[:rank])
    return batches[start : start + shards[rank]]


def api_scenario(
    rank: int, world: int, shards: list[int], sync: str, ranges: tuple[str, ...], export_dir: str | None
) -> dict[str, object]:
    """Calibrate this rank's shard with each preset (and the mixed config, exported to ONNX)."""
    mine = shard(api_batches(sum(shards)), shards, rank)
    out: dict[str, object] = {}
    for activation_range in ranges:
        config = co.QuantizerConfig.presets.w8a8(activation_range=activation_range)
        out[activation_range] = qparams(co.convert(calibrated(config, mine, sync)))
    if export_dir is not None:
        from coreai_opt.api.distributed import check_synchronized

        converted = co.convert(calibrated(mixed_config(), mine, sync))
        out["mixed"] = qparams(converted)
        out["synchronized_tensors"] = check_synchronized(converted)  # every parameter and buffer, across ranks
        out["calculators"] = sorted(
            {type(m.calculator.range_calculator).__name__ for m in converted.modules() if isinstance(m, FakeQuantize)}
        )
        # Rank 0 exports the data-parallel model. Rank 1 meanwhile calibrates the same model on *all* batches
        # with sync="never" (plain single-process calibration) and exports that: the two files must be equal.
        # Exporting here rather than in the parent reuses this process's warm exporter (the test's cost driver).
        if rank == 1:
            single = co.convert(calibrated(mixed_config(), api_batches(sum(shards)), "never"))
            out["single_mixed"] = qparams(single)
            converted = single
        if rank in (0, 1):
            path = co.export_onnx(converted, example_inputs(), Path(export_dir) / f"rank{rank}.onnx")
            out["onnx"] = path.read_bytes()
            os.remove(path)
    return out


# ------------------------------------------------------------------------------------------- moving-average rule
def moving_average_reference(shards: list[int], mode: str) -> dict[str, Tensor]:
    """The documented moving-average merge, simulated in one process on a prepared model.

    ``auto``: ``Σ n_r·m_r / Σ n_r`` of the per-rank EMAs; ``every_batch``: after every step, the mean over the
    ranks that ran a batch of the EMAs each computed from the common state. float64 sums in rank order.
    """
    batches = api_batches(sum(shards))
    per_rank = [shard(batches, shards, r) for r in range(len(shards))]
    model = co.prepare(mlp(), co.QuantizerConfig.presets.w8a8(activation_range="moving_average"), example_inputs())
    co.enable_observers(model, True)
    co.enable_fake_quant(model, False)
    calcs = {
        name: m.calculator
        for name, m in model.named_modules()
        if isinstance(m, FakeQuantize) and isinstance(m.calculator, MovingAverageQParamsCalculator)
    }

    def run(state: dict[str, tuple[Tensor, Tensor]] | None, xs: list[Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        for name, calc in calcs.items():
            calc.reset_statistics()
            if state is not None:
                calc.running_min, calc.running_max = state[name][0].clone(), state[name][1].clone()
        with torch.no_grad():
            for x in xs:
                model(x)
        return {name: (c.running_min.clone(), c.running_max.clone()) for name, c in calcs.items()}

    def merge(
        results: list[dict[str, tuple[Tensor, Tensor]]], weights: list[float]
    ) -> dict[str, tuple[Tensor, Tensor]]:
        merged = {}
        for name in calcs:
            pair = []
            for which in (0, 1):
                num = torch.zeros_like(results[0][name][which], dtype=torch.float64)
                den = torch.zeros_like(num)
                for result, w in zip(results, weights, strict=True):
                    value = result[name][which]
                    num += torch.where(torch.isfinite(value), value.double() * w, torch.zeros_like(num))
                    den += torch.where(torch.isfinite(value), torch.full_like(den, w), torch.zeros_like(den))
                pair.append((num / den).float())
            merged[name] = (pair[0], pair[1])
        return merged

    if mode == "auto":
        ranks = [r for r in range(len(shards)) if shards[r]]
        state = merge([run(None, per_rank[r]) for r in ranks], [float(shards[r]) for r in ranks])
    else:
        state = None
        for step in range(max(shards)):
            active = [r for r in range(len(shards)) if step < shards[r]]
            state = merge([run(state, [per_rank[r][step]]) for r in active], [1.0] * len(active))
    assert state is not None
    out = {}
    for name, calc in calcs.items():
        calc.running_min, calc.running_max = state[name]
        calc.commit()
        for buf in ("scale", "zero_point", "minval", "running_min", "running_max"):
            out[f"{name}.calculator.{buf}"] = getattr(calc, buf).clone()
    return out


def api_failure_scenario(rank: int, world: int, failing_rank: int) -> dict[str, object]:
    """``failing_rank`` feeds a batch of the wrong width: its calibrate raises, the others' must too (no hang).

    The model was calibrated successfully before; ``rolled_back`` says whether the failed call left every tensor
    of its state_dict exactly as after that first calibration (on every rank).
    """
    import time

    from coreai_opt.api.distributed import DistributedSyncError

    prepared = calibrated(co.QuantizerConfig.presets.w8a8(), api_batches(2, seed=5), "auto")
    before = {k: v.clone() for k, v in prepared.state_dict().items() if torch.is_tensor(v)}
    batches = api_batches(4)
    if rank == failing_rank:
        batches[1] = torch.zeros(3, FEATURES + 1)
    start = time.perf_counter()
    try:
        co.calibrate(prepared, batches, progress=False, sync="auto")
    except (ValueError, DistributedSyncError) as exc:
        after = prepared.state_dict()
        rolled_back = all(torch.equal(v, after[k]) for k, v in before.items())
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start,
                "rolled_back": rolled_back}
    return {"error": None, "seconds": time.perf_counter() - start, "rolled_back": False}
