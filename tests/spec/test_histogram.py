"""RowHistogram: exact power-of-two grid, exact merging, bounded memory, distributed all_reduce."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coreai_opt.quantization.ranges.entropy_range_calculator import EntropyRangeCalculator
from coreai_opt.quantization.ranges.histogram import K_FLOOR, MAX_HISTOGRAM_ENTRIES, RowHistogram, check_num_bins
from coreai_opt.quantization.ranges.histogram_range_calculator import HistogramRangeCalculatorBase
from coreai_opt.quantization.ranges.mse_range_calculator import MSERangeCalculator
from coreai_opt.quantization.ranges.percentile_range_calculator import PercentileRangeCalculator
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.spec.granularity import PerBlock, PerChannel


def _assert_same_histogram(a: RowHistogram, b: RowHistogram) -> None:
    assert torch.equal(a.counts, b.counts)
    assert torch.equal(a.exponent, b.exponent)
    assert torch.equal(a.row_min, b.row_min)
    assert torch.equal(a.row_max, b.row_max)


def test_row_histogram_bins_values_on_power_of_two_grid():
    hist = RowHistogram(16)
    hist.update(torch.tensor([[-3.0, -0.25, 0.0, 0.5, 2.9, 3.99]]))
    # max|x| = 3.99 < 2^2 -> k = 2, range [-4, 4), w = 2^3 / 16 = 0.5, bin = floor(x / 0.5) + 8.
    assert hist.exponent.tolist() == [2]
    assert hist.bin_width().tolist() == [0.5]
    expected = torch.zeros(16, dtype=torch.int64)
    for b in (2, 7, 8, 9, 13, 15):
        expected[b] += 1
    assert torch.equal(hist.counts[0], expected)
    assert hist.row_min.tolist() == [-3.0] and hist.row_max.tolist() == [3.990000009536743]


def test_row_histogram_puts_power_of_two_max_inside_the_range():
    hist = RowHistogram(16)
    hist.update(torch.tensor([[4.0, -4.0]]))
    # 4 = 2^2 is not < 2^2, so k = 3: range [-8, 8), w = 1 -> bins 12 and 4.
    assert hist.exponent.tolist() == [3]
    assert hist.counts[0].nonzero().flatten().tolist() == [4, 12]


def test_row_histogram_keeps_tiny_negative_values_left_of_zero():
    # -1e-45 * (B / 2^(k+1)) underflows to -0.0 in float32; it must still land in bin B/2 - 1.
    hist = RowHistogram(16)
    hist.update(torch.tensor([[-1e-45, 1e-45, 1000.0]]))
    assert hist.counts[0, 7].item() == 1 and hist.counts[0, 8].item() == 1


def test_row_histogram_all_zero_rows_use_floor_exponent():
    hist = RowHistogram(32)
    hist.update(torch.zeros(2, 10))
    assert hist.exponent.tolist() == [K_FLOOR, K_FLOOR]
    assert hist.counts[:, 16].tolist() == [10, 10] and int(hist.counts.sum()) == 20
    assert hist.has_statistics


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_shards=st.integers(1, 6),
    per_channel=st.booleans(),
    log_scale_spread=st.integers(0, 12),
)
def test_row_histogram_merge_equals_histogram_of_concatenation(seed, num_shards, per_channel, log_scale_spread):
    g = torch.Generator().manual_seed(seed)
    # Shards at very different scales (up to 2^12 apart) force the grid to grow in different orders.
    shards = []
    for _ in range(num_shards):
        n = int(torch.randint(1, 200, (1,), generator=g))
        scale = 2.0 ** float(torch.randint(-log_scale_spread, log_scale_spread + 1, (1,), generator=g))
        shards.append(torch.randn(n, 3, generator=g) * scale)
    rows = (lambda t: t.t()) if per_channel else (lambda t: t.reshape(1, -1))

    reference = RowHistogram(64)
    reference.update(rows(torch.cat(shards)))

    order = torch.randperm(num_shards, generator=g).tolist()
    sequential = RowHistogram(64)
    for i in order:
        sequential.update(rows(shards[i]))
    _assert_same_histogram(sequential, reference)

    # Independent shard histograms merged in another random order (data-parallel calibration).
    parts = []
    for shard in shards:
        part = RowHistogram(64)
        part.update(rows(shard))
        parts.append(part)
    merged = RowHistogram(64)
    for i in torch.randperm(num_shards, generator=g).tolist():
        merged.merge_(parts[i])
    _assert_same_histogram(merged, reference)
    assert int(merged.counts.sum()) == sum(s.numel() for s in shards)


def test_row_histogram_grows_exactly_when_data_grows_1000x():
    g = torch.Generator().manual_seed(0)
    small, large = torch.randn(1, 5000, generator=g), 1000.0 * torch.randn(1, 5000, generator=g)
    hist = RowHistogram(2048)
    hist.update(small)
    k_small = int(hist.exponent)
    hist.update(large)
    reference = RowHistogram(2048)
    reference.update(torch.cat([small, large], dim=1))
    _assert_same_histogram(hist, reference)
    # The grid grew by 9-10 doublings (1000x ~ 2^10) and is the smallest power of two above max|x|.
    k = int(hist.exponent)
    max_abs = float(large.abs().max())
    assert k - k_small in (9, 10, 11) and 2.0 ** (k - 1) <= max_abs < 2.0**k
    assert int(hist.counts.sum()) == 10000


def test_row_histogram_memory_is_constant_after_1_vs_64_batches():
    g = torch.Generator().manual_seed(1)

    def buffer_elements(calc: torch.nn.Module) -> int:
        return sum(b.numel() for b in calc.buffers())

    one, many = PercentileRangeCalculator(PerChannel(axis=1)), PercentileRangeCalculator(PerChannel(axis=1))
    one.update(torch.randn(32, 8, generator=g))
    for i in range(64):
        many.update(torch.randn(32, 8, generator=g) * (1 + i))
    assert buffer_elements(one) == buffer_elements(many) == 8 * 2048 + 3 * 8 + 1
    assert int(many.histogram.counts.sum()) == 64 * 32 * 8


def test_row_histogram_ignores_non_finite_values():
    hist = RowHistogram(16)
    had = hist.update(torch.tensor([[1.0, float("nan"), -2.0, float("inf")], [float("-inf"), 0.5, 0.25, 3.0]]))
    assert had
    assert hist.counts.sum(dim=1).tolist() == [2, 3]
    assert hist.row_min.tolist() == [-2.0, 0.25] and hist.row_max.tolist() == [1.0, 3.0]


def test_row_histogram_row_without_finite_values_has_no_statistics():
    hist = RowHistogram(16)
    hist.update(torch.full((1, 4), float("nan")))
    assert not hist.has_statistics and int(hist.counts.sum()) == 0


def test_row_histogram_raises_when_rows_times_bins_exceeds_cap():
    calc = PercentileRangeCalculator(PerBlock(axis=1, block_size=2), num_bins=2048)
    rows = MAX_HISTOGRAM_ENTRIES // 2048 + 1
    with pytest.raises(ValueError, match="per-tensor granularity.*minmax"):
        calc.update(torch.zeros(rows, 2))


def test_check_num_bins_rejects_non_power_of_two():
    assert check_num_bins(2048) == 2048
    for bad in (2000, 8, 0, 3.0):
        with pytest.raises(ValueError, match="power of two"):
            check_num_bins(bad)


def test_row_histogram_merge_rejects_mismatched_rows_and_bins():
    a, b, c = RowHistogram(16), RowHistogram(16), RowHistogram(32)
    a.update(torch.ones(2, 3))
    b.update(torch.ones(3, 3))
    with pytest.raises(ValueError, match="rows"):
        a.merge_(b)
    with pytest.raises(ValueError, match="bins"):
        a.merge_(c)


def test_histogram_calculator_rejects_a_differently_shaped_tensor():
    calc = MSERangeCalculator(PerChannel(axis=0))
    calc.update(torch.randn(4, 3))
    with pytest.raises(ValueError, match="reset"):
        calc.update(torch.randn(5, 3))
    calc.reset()
    calc.update(torch.randn(5, 3))
    assert calc.compute_range()[0].shape == (5,)


@pytest.mark.parametrize("key", ["percentile", "mse", "entropy"])
def test_histogram_calculators_are_registered_and_accumulate(key):
    cls = RANGE_CALCULATORS.get_class(key)
    assert issubclass(cls, HistogramRangeCalculatorBase) and cls.accumulates is True


@pytest.mark.parametrize(
    "factory",
    [
        lambda g: PercentileRangeCalculator(g, num_bins=256, percentile=99.0),
        lambda g: MSERangeCalculator(g, num_bins=256, dtype="int4"),
        lambda g: EntropyRangeCalculator(g, num_bins=1024),
    ],
    ids=["percentile", "mse", "entropy"],
)
def test_histogram_calculator_state_dict_round_trip_gives_identical_range(factory):
    g = torch.Generator().manual_seed(2)
    calc = factory(PerChannel(axis=0))
    for i in range(3):
        calc.update(torch.randn(4, 500, generator=g) * torch.tensor([[1.0], [10.0], [0.1], [1e3]]) * (i + 1))
    fresh = factory(PerChannel(axis=0))
    fresh.load_state_dict(calc.state_dict(), strict=True)
    lo, hi = calc.compute_range()
    lo2, hi2 = fresh.compute_range()
    assert lo.shape == (4,) and torch.equal(lo, lo2) and torch.equal(hi, hi2)
    assert (hi > 0).all()
    # The reloaded calculator keeps accumulating on the same grid.
    extra = torch.randn(4, 10, generator=g)
    calc.update(extra)
    fresh.update(extra)
    assert torch.equal(calc.histogram.counts, fresh.histogram.counts)


def test_histogram_calculator_state_dict_round_trip_per_tensor_scalar_shape():
    calc = PercentileRangeCalculator()
    calc.update(torch.linspace(-1, 1, 1001))
    fresh = PercentileRangeCalculator()
    fresh.load_state_dict(calc.state_dict(), strict=True)
    assert fresh.compute_range()[1].shape == () and torch.equal(fresh.compute_range()[1], calc.compute_range()[1])


def test_histogram_calculator_counts_every_element_of_a_large_activation():
    calc = PercentileRangeCalculator()
    x = torch.randn(10, 1, 320, 320, generator=torch.Generator().manual_seed(3))
    for _ in range(6):
        calc.update(x)
    # speed is measured in benchmarks/ (pipeline cost section), not asserted here
    assert int(calc.histogram.counts.sum()) == 6 * x.numel()
    assert calc.histogram.counts.shape == (1, 2048)


# ----------------------------------------------------------------------------------- torch.distributed


def _dist_shards() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(64, 3, generator=g) * 10.0**i for i in range(-1, 3)]


def _make_calculators() -> list[HistogramRangeCalculatorBase]:
    return [
        PercentileRangeCalculator(PerChannel(axis=1), num_bins=512, percentile=99.0),
        MSERangeCalculator(PerChannel(axis=1), num_bins=512, dtype="int8"),
        EntropyRangeCalculator(PerChannel(axis=1), num_bins=512),
    ]


def _dist_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        shards = _dist_shards()
        results = {}
        # Scenario "split": rank 0 sees shards 0 and 3, rank 1 sees 1 and 2 (different grid growth orders).
        # Scenario "idle": rank 1 sees no data at all and must still end with the full statistics.
        assignment = {"split": {0: [0, 3], 1: [2, 1]}, "idle": {0: [0, 1, 2, 3], 1: []}}
        for scenario, per_rank in assignment.items():
            calcs = _make_calculators()
            for calc in calcs:
                for i in per_rank[rank]:
                    calc.update(shards[i])
                calc.all_reduce()
            results[scenario] = [(c.compute_range(), c.histogram.counts.clone()) for c in calcs]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_histogram_calculators_all_reduce_equals_single_process_even_with_an_idle_rank(tmp_path):
    # fork: the children reuse the imported modules (spawn re-imports torch: ~20 s on a loaded 2-core box);
    # they run single-threaded, so no OpenMP pool is inherited in use.
    ctx = mp.get_context("fork")
    init_file = str(tmp_path / "init")
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, init_file, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    reference = _make_calculators()
    for calc in reference:
        calc.update(torch.cat(_dist_shards()))
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for scenario in ("split", "idle"):
            for calc, ((lo, hi), counts) in zip(reference, results[scenario], strict=True):
                ref_lo, ref_hi = calc.compute_range()
                assert torch.equal(counts, calc.histogram.counts), (rank, scenario, type(calc).__name__)
                assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi), (rank, scenario, type(calc).__name__)


def test_histogram_calculator_merge_of_shards_equals_single_process():
    shards = _dist_shards()
    for make in (lambda: _make_calculators()[0], lambda: _make_calculators()[2]):
        whole, merged = make(), make()
        whole.update(torch.cat(shards))
        for shard in reversed(shards):
            part = make()
            part.update(shard)
            merged.merge_(part)
        assert torch.equal(whole.compute_range()[1], merged.compute_range()[1])


def test_non_finite_warning_names_the_calculator_once():
    calc = EntropyRangeCalculator()
    calc.name = "conv1.output"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calc.update(torch.tensor([1.0, math.nan]))
        calc.update(torch.tensor([2.0, math.inf]))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith("conv1.output")
