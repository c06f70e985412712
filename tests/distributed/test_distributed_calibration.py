"""Data-parallel calibration on gloo CPU ranks equals single-process calibration (or its documented rule).

The distributed tests run real gloo ranks (``dist_harness.RankRun``) with a hard timeout, so a hang fails the test
instead of blocking CI. Several scenarios share one spawn because process start-up dominates the cost.
"""

from __future__ import annotations

import pytest
import torch
from dist_api_workers import (
    EXACT_RANGES,
    RANGES,
    api_batches,
    calibrated,
    mixed_config,
    moving_average_reference,
    qparams,
)
from dist_harness import RankRun, values
from dist_workers import (
    EMA_C,
    commit,
    feed,
    make_bank,
    make_batches,
    many_scenarios,
    shard_indices,
    snapshot,
)

import coreai_opt as co
from coreai_opt.api.distributed import CalibrationSync, check_synchronized, is_main_process, sync_statistics

pytestmark = pytest.mark.timeout(180)  # per test; the ranks themselves are killed after 120 s

EXACT = ("global_minmax", "global_minmax_pc", "percentile", "percentile_pc", "mse", "entropy")
MOVING = ("moving_average", "moving_average_pc")
QPARAMS = ("scale", "zero_point", "minval")
RANGE_CLASSES = {
    "minmax": "MinMaxRangeCalculator",
    "percentile": "PercentileRangeCalculator",
    "mse": "MSERangeCalculator",
    "entropy": "EntropyRangeCalculator",
}


# ------------------------------------------------------------------------------------------- references
def single_process(num_batches: int) -> dict[str, torch.Tensor]:
    bank = make_bank()
    feed(bank, make_batches(num_batches))
    commit(bank)
    return snapshot(bank)


def per_rank_banks(shards: list[int]) -> list[torch.nn.ModuleDict]:
    batches = make_batches(sum(shards))
    banks = []
    for rank in range(len(shards)):
        bank = make_bank()
        feed(bank, [batches[i] for i in shard_indices(shards, rank)])
        banks.append(bank)
    return banks


def weighted_mean(values_: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The documented rule, written independently: Σ w·m / Σ w in float64, rank order, finite entries only."""
    num = torch.zeros_like(values_[0], dtype=torch.float64)
    den = torch.zeros_like(values_[0], dtype=torch.float64)
    for v, w in zip(values_, weights, strict=True):
        if w == 0 or v.numel() == 0:
            continue
        finite = torch.isfinite(v)
        num = num + torch.where(finite, v.double() * w, torch.zeros_like(num))
        den = den + torch.where(finite, torch.full_like(den, w), torch.zeros_like(den))
    return (num / den).float()


def committed_moving_average(key: str, running_min: torch.Tensor, running_max: torch.Tensor) -> dict[str, torch.Tensor]:
    calc = make_bank()[key].calculator
    calc.running_min, calc.running_max = running_min.clone(), running_max.clone()
    calc.commit()
    return {"running_min": running_min, "running_max": running_max, **{q: getattr(calc, q) for q in QPARAMS}}


def moving_average_end_rule(shards: list[int], key: str, weighted: bool = True) -> dict[str, torch.Tensor]:
    """sync='auto': mean of the per-rank EMAs weighted by each rank's batch count (unweighted: 1 per rank with data)."""
    banks = per_rank_banks(shards)
    mins = [b[key].calculator.running_min for b in banks]
    maxs = [b[key].calculator.running_max for b in banks]
    weights = [float(n) if weighted else float(n > 0) for n in shards]
    return committed_moving_average(key, weighted_mean(mins, weights), weighted_mean(maxs, weights))


def moving_average_step_rule(shards: list[int], key: str) -> dict[str, torch.Tensor]:
    """sync='every_batch': after each step, the plain mean over the ranks that ran a batch in that step."""
    batches = make_batches(sum(shards))
    shard_batches = [[batches[i] for i in shard_indices(shards, r)] for r in range(len(shards))]
    running: tuple[torch.Tensor, torch.Tensor] | None = None
    for step in range(max(shards)):
        mins, maxs, weights = [], [], []
        for rank_batches in shard_batches:
            calc = make_bank()[key].calculator
            if running is not None:
                calc.running_min, calc.running_max = running[0].clone(), running[1].clone()
            if step < len(rank_batches):
                calc.observe(rank_batches[step])
                mins.append(calc.running_min)
                maxs.append(calc.running_max)
                weights.append(1.0)
        running = (weighted_mean(mins, weights), weighted_mean(maxs, weights))
    assert running is not None
    return committed_moving_average(key, *running)


def static_minmax_rule(shards: list[int]) -> dict[str, torch.Tensor]:
    """static + minmax: MIN / MAX over the last batch of every rank that has one."""
    batches = make_batches(sum(shards))
    lasts = [batches[shard_indices(shards, r)[-1]] for r in range(len(shards)) if shards[r]]
    calc = make_bank()["static_minmax"].calculator
    calc.range_calculator.min_val = torch.stack([x.min() for x in lasts]).min()
    calc.range_calculator.max_val = torch.stack([x.max() for x in lasts]).max()
    calc.commit()
    return {q: getattr(calc, q) for q in QPARAMS}


# ------------------------------------------------------------------------------------------- assertions
def assert_ranks_identical(states: list[dict[str, torch.Tensor]]) -> None:
    for rank, state in enumerate(states[1:], start=1):
        assert state.keys() == states[0].keys()
        for key, value in state.items():
            assert torch.equal(value, states[0][key]), f"rank {rank} differs from rank 0 in {key}"


def assert_matches(state: dict[str, torch.Tensor], prefix: str, expected: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        got = state[f"{prefix}.calculator.{name}"]
        assert torch.equal(got, value), f"{prefix}.{name}: got {got.tolist()}, expected {value.tolist()}"


def assert_calculator_results(result: dict[str, object], shards: list[int], mode: str) -> None:
    """``mode``: "auto" / "every_batch" (CalibrationSync) or "direct" (sync_statistics with default weights)."""
    state = result["state"]
    reference = single_process(sum(shards))
    for key in EXACT:  # order-independent rules: bit-exact single-process result, histograms included
        stats = {k.split(".calculator.", 1)[1]: v for k, v in reference.items() if k.startswith(f"{key}.calculator.")}
        stats = {k: v for k, v in stats.items() if not k.startswith("range_calculator.min_val")}
        stats = {k: v for k, v in stats.items() if not k.startswith("range_calculator.max_val")}
        assert_matches(state, key, stats)
    for key in MOVING:
        if mode == "every_batch":
            expected = moving_average_step_rule(shards, key)
        else:
            expected = moving_average_end_rule(shards, key, weighted=mode == "auto")
        assert_matches(state, key, expected)
    assert_matches(state, "static_minmax", static_minmax_rule(shards))


def api_reference(shards: list[int], sync: str, ranges: tuple[str, ...], export: bool = False) -> dict[str, object]:
    """What every rank must hold: single-process calibration on all batches (moving average: its rule)."""
    batches = api_batches(sum(shards))
    out: dict[str, object] = {}
    for activation_range in ranges:
        config = co.QuantizerConfig.presets.w8a8(activation_range=activation_range)
        expected = qparams(co.convert(calibrated(config, batches, "never")))
        if activation_range == "moving_average":
            rule = moving_average_reference(shards, sync)
            assert len(rule) >= 2 * 5 and set(rule) <= set(expected)  # >= 2 activation quantizers, 5 buffers each
            expected.update(rule)
        out[activation_range] = expected
    if export:
        out["mixed"] = qparams(co.convert(calibrated(mixed_config(), batches, "never")))
        out["calculators"] = sorted(RANGE_CLASSES[r] for r in EXACT_RANGES)
    return out


def assert_api_results(per_rank: list[dict[str, object]], reference: dict[str, object]) -> None:
    """Every rank holds exactly the reference: qparam buffers, calculator types; ONNX bytes = single process."""
    for rank, result in enumerate(per_rank):
        for key, expected in reference.items():
            if isinstance(expected, dict):
                assert_same_tensors(result[key], expected, f"rank {rank}, {key}")
            else:
                assert result[key] == expected, f"rank {rank}: {key} differs from the single-process result"
    if "mixed" in reference:
        assert all(r["synchronized_tensors"] > 50 for r in per_rank)  # all parameters and buffers compared
        assert_same_tensors(per_rank[1]["single_mixed"], reference["mixed"], "rank 1 single-process calibration")
        data_parallel, single_process = per_rank[0]["onnx"], per_rank[1]["onnx"]
        assert len(data_parallel) > 1000 and data_parallel == single_process


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: {sorted(set(got) ^ set(expected))}"
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{what}: {key} = {got[key].tolist()}, expected {value.tolist()}"


# ------------------------------------------------------------------------------------------- tests
def test_two_ranks_even_shards_write_once_mismatch_and_barrier(tmp_path) -> None:
    shards = [3, 3]
    plan = [
        ("calculators", (shards, "auto")),
        ("write_once", (str(tmp_path),)),
        ("mismatch", ()),
        ("api", ([3, 2], "auto", RANGES, str(tmp_path))),
        ("barrier_timeout", (1, 2.0)),  # last: a timed-out group is unusable
    ]
    ranks = RankRun(many_scenarios, 2, plan, timeout=120)
    reference = api_reference([3, 2], "auto", RANGES, export=True)  # computed while the ranks run
    results = values(ranks.results())
    states = [r[0]["state"] for r in results]
    assert_ranks_identical(states)
    assert [r[0]["synced"] for r in results] == [len(make_bank())] * 2
    assert_calculator_results(results[0][0], shards, "auto")
    # The shards really differ: without the merge, rank 0 alone would not give the single-process qparams.
    alone = per_rank_banks(shards)[0]
    commit(alone)
    assert not torch.equal(alone["global_minmax"].calculator.scale, states[0]["global_minmax.calculator.scale"])

    once = [r[1] for r in results]
    assert [o["calls"] for o in once] == [[0], []]  # written by rank 0 only ...
    assert [o["loaded"] for o in once] == [{"writer": 0}] * 2  # ... and readable by every rank on return
    assert [o["result"] for o in once] == ["ran on 0", None]
    assert once[0]["error"] == "OSError: disk full"
    assert once[1]["error"].startswith("DistributedSyncError") and "disk full" in once[1]["error"]

    mismatch = [r[2] for r in results]
    assert mismatch[0]["compared"] == mismatch[1]["compared"] == len(snapshot(make_bank()))
    for m in mismatch:
        assert "'entropy.calculator.scale' differs between rank 0 and rank(s) [1]" in m["differs"]
        assert "different quantizer sets" in m["structure"]

    assert_api_results([r[3] for r in results], reference)

    late = results[0][4]
    assert "Ranks 1 failed to pass monitoredBarrier" in late["error"] and 1.5 < late["seconds"] < 15.0
    assert results[1][4]["error"] is None


def test_three_ranks_uneven_zero_batch_failure_and_timeout() -> None:
    plan = [
        ("calculators", ([4, 0, 2], "auto")),  # rank 1 sees no data at all
        ("calculators", ([1, 3, 0], "every_batch")),  # lock-step while ranks run out at different steps
        ("direct", ([2, 0, 1],)),  # sync_statistics called directly: moving averages weigh 1 per rank with data
        ("api", ([2, 0, 3], "auto", ("mse", "moving_average"), None)),
        ("api", ([2, 0, 3], "every_batch", ("minmax", "moving_average", "percentile"), None)),
        ("failure", (1, 2)),  # rank 1 raises at its third batch
        ("api_failure", (2,)),  # calibrate raises on rank 2 (bad batch): the other ranks' calibrate raises too
        ("silent", (2, 3.0)),  # rank 2 never reaches the sync point: the others give up after 3 s
    ]
    ranks = RankRun(many_scenarios, 3, plan, timeout=120)
    references = [api_reference(*plan[i][1][:3]) for i in (3, 4)]  # computed while the ranks run
    results = values(ranks.results())
    for index, (name, (shards, *mode)) in enumerate(plan[:3]):
        assert_ranks_identical([r[index]["state"] for r in results])
        assert_calculator_results(results[0][index], shards, mode[0] if mode else name)
    assert [r[2]["synced"] for r in results] == [len(make_bank())] * 3

    assert_api_results([r[3] for r in results], references[0])
    assert_api_results([r[4] for r in results], references[1])

    failures = [r[5] for r in results]
    assert failures[1]["error"] == "ValueError: bad batch 2 on rank 1"
    for rank in (0, 2):
        assert failures[rank]["error"].startswith("DistributedSyncError")
        assert "rank(s) [1]" in failures[rank]["error"] and "bad batch 2 on rank 1" in failures[rank]["error"]
        assert failures[rank]["seconds"] < 15.0  # immediate: neither a per-call (20 s) nor the group timeout (60 s)

    api_failures = [r[6] for r in results]
    assert api_failures[2]["error"].startswith("InputValidationError: calibration batch 1 failed")
    assert all(f["rolled_back"] for f in api_failures)  # every rank's failed calibrate left its model as before
    for rank in (0, 1):
        assert api_failures[rank]["error"].startswith("DistributedSyncError")
        assert (
            "rank(s) [2]" in api_failures[rank]["error"] and "calibration batch 1 failed" in api_failures[rank]["error"]
        )
        assert api_failures[rank]["seconds"] < 15.0

    silent = [r[7] for r in results]
    for rank in (0, 1):
        assert silent[rank]["error"] is not None and "timed out" in silent[rank]["error"]
        assert 2.5 < silent[rank]["seconds"] < 15.0  # our 3 s timeout, not the group timeout (60 s)


def test_without_process_group_everything_is_local() -> None:
    bank = make_bank()
    feed(bank, make_batches(3))
    before = snapshot(bank)
    assert sync_statistics(bank) == 0
    assert check_synchronized(bank) == 0
    assert is_main_process()
    with CalibrationSync(bank, "every_batch") as syncer:
        syncer.after_batch()
    assert not syncer.enabled and syncer.synced == 0
    after = snapshot(bank)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="sync='sometimes' is not one of"):
        CalibrationSync(bank, "sometimes")


def test_ema_constant_is_large_enough_to_tell_rules_apart() -> None:
    # Guards the moving-average tests: with a visible EMA constant the per-rank, end and step rules differ.
    assert EMA_C >= 0.1
    end = moving_average_end_rule([1, 3, 0], "moving_average")["running_max"]
    step = moving_average_step_rule([1, 3, 0], "moving_average")["running_max"]
    assert not torch.equal(end, step)
