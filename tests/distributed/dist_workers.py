"""Per-rank scenarios for the distributed calibration tests (module-level so spawned ranks can import them).

The shared pieces (data, quantizer bank, reference rules) are also used by the parent process to compute the
single-process references, so both sides build exactly the same quantizers and batches.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from coreai_opt.api.distributed import CalibrationSync, DistributedSyncError, sync_statistics
from coreai_opt.quantization.spec import FakeQuantize, PerChannel, QuantizationSpec

EMA_C = 0.25  # a large averaging constant so that the moving-average rule is clearly visible


# ------------------------------------------------------------------------------------------- shared data
def make_batches(num_batches: int, seed: int = 0) -> list[Tensor]:
    """Heavy-tailed activations ``(batch, 3 channels, 16)`` with per-batch outliers, varying batch sizes."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(num_batches):
        x = torch.randn(2 + i % 3, 3, 16, generator=gen) * torch.tensor([0.5, 1.0, 3.0]).view(1, 3, 1)
        x = x + 0.1 * i
        x.view(-1)[i % x.numel()] = 8.0 + i  # an outlier that percentile / mse / entropy should clip
        batches.append(x)
    return batches


def _spec(
    range_calculator: str, qparams_calculator: str, *, per_channel: bool = False, **kw: object
) -> QuantizationSpec:
    return QuantizationSpec(
        dtype="int8" if per_channel else "uint8",
        qscheme="symmetric" if per_channel else "asymmetric",
        granularity=PerChannel(axis=1) if per_channel else {"type": "per_tensor"},
        range_calculator=range_calculator,
        qparams_calculator=qparams_calculator,
        **kw,
    )


def make_bank() -> nn.ModuleDict:
    """One FakeQuantize per merge rule, observers on and fake quant off (calibration mode)."""
    specs = {
        "global_minmax": _spec("minmax", "global_minmax"),
        "global_minmax_pc": _spec("minmax", "global_minmax", per_channel=True),
        "percentile": _spec("percentile", "static", num_bins=256, percentile=99.0),
        "percentile_pc": _spec("percentile", "static", per_channel=True, num_bins=256, percentile=99.0),
        "mse": _spec("mse", "static", num_bins=256),
        "entropy": _spec("entropy", "static", num_bins=256),
        "moving_average": _spec("minmax", "moving_average", averaging_constant=EMA_C),
        "moving_average_pc": _spec("minmax", "moving_average", per_channel=True, averaging_constant=EMA_C),
        "static_minmax": _spec("minmax", "static"),
    }
    bank = nn.ModuleDict({name: FakeQuantize(spec) for name, spec in specs.items()})
    for name, fq in bank.items():
        fq.set_name(name)
        fq.enable_fake_quant(False)
    return bank


def feed(bank: nn.ModuleDict, batches: list[Tensor]) -> None:
    for x in batches:
        for fq in bank.values():
            fq(x)


def commit(bank: nn.ModuleDict) -> None:
    for fq in bank.values():
        fq.commit()


def snapshot(module: nn.Module) -> dict[str, Tensor]:
    """The module's tensor state (without the quantizers' ``_extra_state`` spec dicts)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, Tensor)}


def shard_indices(spec: list[int], rank: int) -> list[int]:
    """Contiguous shards: ``spec[r]`` batches for rank ``r``, taken in order from the full set."""
    start = sum(spec[:rank])
    return list(range(start, start + spec[rank]))


# ------------------------------------------------------------------------------------------- rank scenarios
def calculators_scenario(rank: int, world: int, shards: list[int], sync: str) -> dict[str, object]:
    """Feed this rank's shard through the bank inside ``CalibrationSync``, commit, return the state."""
    batches = make_batches(sum(shards))
    mine = [batches[i] for i in shard_indices(shards, rank)]
    bank = make_bank()
    start = time.perf_counter()
    with CalibrationSync(bank, sync, timeout=20.0) as syncer:
        for x in mine:
            for fq in bank.values():
                fq(x)
            syncer.after_batch()
    commit(bank)
    return {"state": snapshot(bank), "synced": syncer.synced, "seconds": time.perf_counter() - start}


def direct_scenario(rank: int, world: int, shards: list[int]) -> dict[str, object]:
    """A custom loop calling ``sync_statistics`` itself (default moving-average weights), then committing."""
    batches = make_batches(sum(shards))
    bank = make_bank()
    feed(bank, [batches[i] for i in shard_indices(shards, rank)])
    synced = sync_statistics(bank, timeout=20.0)
    commit(bank)
    return {"state": snapshot(bank), "synced": synced}


def failure_scenario(rank: int, world: int, failing_rank: int, fail_at: int) -> dict[str, object]:
    """``failing_rank`` raises at batch ``fail_at``; every rank reports what it saw and how long it took."""
    batches = make_batches(6)
    bank = make_bank()
    start = time.perf_counter()
    try:
        with CalibrationSync(bank, "every_batch", timeout=20.0) as syncer:
            for i, x in enumerate(batches):
                if rank == failing_rank and i == fail_at:
                    raise ValueError(f"bad batch {i} on rank {rank}")
                feed(bank, [x])
                syncer.after_batch()
    except (ValueError, DistributedSyncError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def silent_rank_scenario(rank: int, world: int, silent_rank: int, timeout: float) -> dict[str, object]:
    """``silent_rank`` never reaches the sync point (stuck); the others must raise within ``timeout``."""
    bank = make_bank()
    feed(bank, make_batches(2))
    start = time.perf_counter()
    if rank == silent_rank:
        time.sleep(timeout + 0.5)
        return {"error": None, "seconds": time.perf_counter() - start}
    try:
        sync_statistics(bank, timeout=timeout)
    except DistributedSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def write_once_scenario(rank: int, world: int, directory: str) -> dict[str, object]:
    """save_on_main writes once and the file exists on return; run_on_main failures reach every rank."""
    from pathlib import Path

    from coreai_opt.api.distributed import run_on_main, save_on_main

    calls = []
    path = save_on_main(lambda p: (calls.append(rank), torch.save({"writer": rank}, p)), Path(directory) / "w.pt")
    loaded = torch.load(path, weights_only=True)
    result = run_on_main(lambda: f"ran on {rank}")
    try:
        run_on_main(lambda: (_ for _ in ()).throw(OSError("disk full")))
        error = None
    except (OSError, DistributedSyncError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"calls": calls, "loaded": loaded, "result": result, "error": error}


def mismatch_scenario(rank: int, world: int) -> dict[str, object]:
    """check_synchronized finds a differing buffer; different quantizer sets fail before any merge."""
    from coreai_opt.api.distributed import check_synchronized

    bank = make_bank()
    feed(bank, make_batches(2))
    sync_statistics(bank)
    commit(bank)
    out: dict[str, object] = {"compared": check_synchronized(bank)}
    if rank == world - 1:
        bank["entropy"].calculator.scale.mul_(1.0001)
    try:
        check_synchronized(bank)
        out["differs"] = None
    except DistributedSyncError as exc:
        out["differs"] = str(exc)
    if rank == 0:
        bank["extra"] = FakeQuantize(_spec("minmax", "global_minmax"))
    try:
        sync_statistics(bank, timeout=20.0)
        out["structure"] = None
    except DistributedSyncError as exc:
        out["structure"] = str(exc)
    return out


def barrier_timeout_scenario(rank: int, world: int, late_rank: int, timeout: float) -> dict[str, object]:
    """A normal barrier passes; then ``late_rank`` never arrives and the others fail after ``timeout``."""
    from coreai_opt.api.distributed import barrier

    barrier(timeout=20.0)
    start = time.perf_counter()
    if rank == late_rank:
        time.sleep(timeout + 0.5)
        return {"error": None, "seconds": time.perf_counter() - start}
    try:
        barrier(timeout=timeout)
    except DistributedSyncError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def many_scenarios(rank: int, world: int, plan: list[tuple[str, tuple[object, ...]]]) -> list[object]:
    """Run several scenarios in one spawn (process start-up dominates the test time)."""
    from dist_api_workers import api_failure_scenario, api_scenario

    table = {
        "api": api_scenario,
        "api_failure": api_failure_scenario,
        "calculators": calculators_scenario,
        "direct": direct_scenario,
        "failure": failure_scenario,
        "silent": silent_rank_scenario,
        "write_once": write_once_scenario,
        "mismatch": mismatch_scenario,
        "barrier_timeout": barrier_timeout_scenario,
    }
    return [table[name](rank, world, *args) for name, args in plan]
