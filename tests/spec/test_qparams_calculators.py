from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from coreai_opt.quantization.spec import (
    QPARAMS_CALCULATORS,
    SCALE_EPS,
    DynamicQParamsCalculator,
    GlobalMinMaxQParamsCalculator,
    MovingAverageQParamsCalculator,
    PerBlock,
    PerChannel,
    PerTensor,
    QuantizationSpec,
    StaticQParamsCalculator,
)

X = torch.tensor([[-1.0, 3.0, -2.0, 1.0], [0.5, 2.0, 0.0, 0.0]])
GRANULARITIES = {"per_tensor": PerTensor(), "per_channel": PerChannel(0), "per_block": PerBlock(axis=1, block_size=2)}

# Hand-computed int8 qparams of X. Group ranges:
#   per_tensor: (-2, 3); per_channel rows: (-2, 3), (0, 2); per_block: (-1, 3), (-2, 1), (0, 2), (0, 0).
# (granularity, scheme): (scales, zero points)
EXPECTED = {
    ("per_tensor", "symmetric"): ([3 / 127.5], [0]),
    ("per_tensor", "symmetric_with_clipping"): ([3 / 127], [0]),
    ("per_tensor", "asymmetric"): ([5 / 255], [-26]),  # -128 - round(-2 / (5/255)) = -128 + 102
    ("per_channel", "symmetric"): ([3 / 127.5, 2 / 127.5], [0, 0]),
    ("per_channel", "symmetric_with_clipping"): ([3 / 127, 2 / 127], [0, 0]),
    ("per_channel", "asymmetric"): ([5 / 255, 2 / 255], [-26, -128]),
    ("per_block", "symmetric"): ([3 / 127.5, 2 / 127.5, 2 / 127.5, SCALE_EPS], [0, 0, 0, 0]),
    ("per_block", "symmetric_with_clipping"): ([3 / 127, 2 / 127, 2 / 127, SCALE_EPS], [0, 0, 0, 0]),
    ("per_block", "asymmetric"): ([4 / 255, 3 / 255, 2 / 255, SCALE_EPS], [-64, 42, -128, -128]),
}

# Batches whose accumulated statistics equal the range of X for each calculator (averaging_constant = 0.5):
#   static: the last batch only; global_minmax: running min/max; moving_average: 0.5·range(2X) + 0.5·range(0).
BATCHES = {
    "static": [5 * X, X],
    "global_minmax": [0.5 * X, X, 0.25 * X],
    "moving_average": [2 * X, 0 * X],
    "dynamic": [X],
}


@pytest.mark.parametrize("calculator", list(BATCHES))
@pytest.mark.parametrize(("granularity", "scheme"), list(EXPECTED))
def test_calculator_exact_qparams(calculator: str, granularity: str, scheme: str) -> None:
    spec = QuantizationSpec(
        dtype="int8",
        qscheme=scheme,
        granularity=GRANULARITIES[granularity],
        qparams_calculator=calculator,
        averaging_constant=0.5,
    )
    calc = QPARAMS_CALCULATORS.get_class(calculator).from_spec(spec)
    for batch in BATCHES[calculator]:
        scale, zero_point, minval = calc(batch)
    exp_scale, exp_zp = EXPECTED[granularity, scheme]
    assert tuple(scale.shape) == GRANULARITIES[granularity].qparam_shape(X.shape)
    assert torch.equal(scale.flatten(), torch.tensor(exp_scale))
    assert zero_point.flatten().tolist() == exp_zp
    assert torch.equal(minval, (spec.quant_min - zero_point).float() * scale)


def test_moving_average_follows_ema_with_default_constant() -> None:
    calc = MovingAverageQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="moving_average"))
    for peak in (1.0, 2.0, 4.0):
        calc.observe(torch.tensor([-peak / 2, peak]))
    # m1 = 1; m2 = 0.99·1 + 0.01·2 = 1.01; m3 = 0.99·1.01 + 0.01·4 = 1.0399
    assert calc.running_max.item() == pytest.approx(1.0399, rel=1e-6)
    assert calc.running_min.item() == pytest.approx(-1.0399 / 2, rel=1e-6)
    calc.commit()
    assert calc.scale.item() == pytest.approx(1.0399 / 127.5, rel=1e-6)


def test_running_calculators_keep_groups_without_finite_values() -> None:
    spec = QuantizationSpec(dtype="int8", granularity=PerChannel(0), qparams_calculator="global_minmax")
    calc = GlobalMinMaxQParamsCalculator(spec)
    with pytest.warns(RuntimeWarning):
        calc.observe(torch.tensor([[1.0, -1.0], [float("nan"), float("inf")]]))
    calc.observe(torch.tensor([[0.5, 0.5], [2.0, -4.0]]))
    assert calc.running_min.tolist() == [-1.0, -4.0]
    assert calc.running_max.tolist() == [1.0, 2.0]


def test_observe_only_accumulates_and_commit_writes_buffers() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    calc.observe(torch.tensor([-1.0, 2.55]))
    assert not calc.has_qparams and calc.scale.numel() == 0
    calc.commit()
    assert calc.has_qparams and calc.scale.item() == pytest.approx(2.55 / 127.5, rel=1e-7)


def test_float_range_overrides_observed_ends() -> None:
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", float_range=(-1.0, None))
    calc = StaticQParamsCalculator(spec)
    calc(torch.tensor([-0.25, 2.0]))
    # Range [-1, 2]: scale 3/255, zp 0 - round(-1 / (3/255)) = 85
    assert calc.scale.item() == torch.tensor(3 / 255).item()
    assert calc.zero_point.item() == 85


def test_float_range_with_both_ends_commits_without_data() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8", float_range=(-2.0, 1.0)))
    calc.commit()
    assert calc.scale.item() == torch.tensor(2 / 127.5).item()
    per_channel = StaticQParamsCalculator(
        QuantizationSpec(dtype="int8", granularity=PerChannel(0), float_range=(-2.0, 1.0))
    )
    with pytest.raises(RuntimeError, match="call initialize"):
        per_channel.commit()
    per_channel.initialize((3, 5))
    per_channel.commit()
    assert per_channel.scale.tolist() == [torch.tensor(2 / 127.5).item()] * 3


def test_commit_without_statistics_raises() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    with pytest.raises(RuntimeError, match="no finite value was observed"):
        calc.commit()


def test_export_mode_freezes_buffers_and_observes_nothing() -> None:
    calc = MovingAverageQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="moving_average"))
    calc(torch.tensor([-1.0, 1.0]))
    frozen = (calc.scale.clone(), calc.zero_point.clone(), calc.running_max.clone())
    calc.set_export_mode(True)
    scale, zero_point, minval = calc(torch.tensor([-100.0, 100.0]))
    assert scale is calc.scale and zero_point is calc.zero_point and minval is calc.minval
    assert torch.equal(calc.scale, frozen[0]) and torch.equal(calc.zero_point, frozen[1])
    assert torch.equal(calc.running_max, frozen[2])
    calc.set_export_mode(False)
    calc(torch.tensor([-100.0, 100.0]))
    assert calc.scale.item() > frozen[0].item()


def test_set_export_mode_raises_without_qparams() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    calc.set_name("fc.weight")
    with pytest.raises(RuntimeError, match=r"fc\.weight: cannot enter export mode without qparams.*calibrate"):
        calc.set_export_mode(True)


def test_get_qparams_warns_before_any_commit() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    with pytest.warns(RuntimeWarning, match="before any qparams were computed"):
        calc.get_qparams()
    calc(torch.tensor([1.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale, zp, minval = calc.get_qparams()
    assert zp.item() == 0 and minval.item() == pytest.approx(-128 / 127.5, rel=1e-6)


def test_stateful_calculator_raises_on_shape_change() -> None:
    for key in ("static", "global_minmax"):
        calc = QPARAMS_CALCULATORS.get_class(key)(
            QuantizationSpec(dtype="int8", granularity=PerChannel(1), qparams_calculator=key)
        )
        calc(torch.randn(2, 4))
        with pytest.raises(ValueError, match=r"from \(4,\) to \(6,\).*StatelessQParamsCalculatorBase"):
            calc(torch.randn(2, 6))


def test_stateless_calculator_rules() -> None:
    spec = QuantizationSpec(dtype="int8", granularity=PerChannel(-2), qparams_calculator="dynamic")
    calc = DynamicQParamsCalculator(spec)
    short, long = torch.randn(2, 3, 8), torch.randn(2, 7, 8)
    assert calc(short)[0].shape == (3,)
    scale, zp, _ = calc(long)
    assert scale.shape == (7,) and zp.tolist() == [0] * 7
    expected = long.abs().amax(dim=(0, 2)) / 127.5
    assert torch.equal(scale, expected)
    assert not calc.has_qparams
    assert not [n for n, _ in calc.named_buffers() if not n.startswith("range_calculator.")]
    with pytest.raises(RuntimeError, match="cannot be frozen for export"):
        calc.set_export_mode(True)
    calc.set_export_mode(False)
    with pytest.raises(RuntimeError, match="no cached qparams"):
        calc.get_qparams()


def test_non_finite_values_are_ignored_with_warning_naming_the_calculator() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    calc.set_name("conv1.output")
    with pytest.warns(RuntimeWarning, match=r"conv1\.output\.MinMaxRangeCalculator.*NaN or Inf"):
        scale, _, _ = calc(torch.tensor([float("nan"), -1.0, 2.55, float("inf"), -float("inf")]))
    assert scale.item() == torch.tensor(2.55 / 127.5).item()


def test_all_zero_tensor_gives_finite_eps_scale() -> None:
    for key in ("static", "moving_average", "global_minmax", "dynamic"):
        calc = QPARAMS_CALCULATORS.get_class(key)(QuantizationSpec(dtype="uint8", qscheme="asymmetric",
                                                                   qparams_calculator=key))
        scale, zp, _ = calc(torch.zeros(4, 4))
        assert scale.item() == SCALE_EPS and zp.item() == 0


def test_reset_statistics_keeps_qparams() -> None:
    calc = GlobalMinMaxQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="global_minmax"))
    calc(torch.tensor([-1.0, 1.0]))
    calc.reset_statistics()
    assert not calc.has_statistics and calc.has_qparams
    calc(torch.tensor([-0.5, 0.5]))
    assert calc.scale.item() == torch.tensor(0.5 / 127.5).item()  # the old, wider range was forgotten


@pytest.mark.parametrize("key", ["static", "moving_average", "global_minmax"])
def test_state_dict_loads_into_never_run_calculator(key: str) -> None:
    spec = QuantizationSpec(dtype="int4", qscheme="asymmetric", granularity=PerBlock(1, 4), qparams_calculator=key)
    trained = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    for _ in range(3):
        trained(torch.randn(3, 8))
    fresh = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert fresh.has_qparams
    for (name, a), (_, b) in zip(trained.named_buffers(), fresh.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    fresh.set_export_mode(True)
    assert torch.equal(fresh(torch.randn(3, 8))[0], trained.scale)


def test_extra_repr_shows_spec_mode_and_abbreviated_qparams() -> None:
    calc = StaticQParamsCalculator(QuantizationSpec(dtype="int8", granularity=PerChannel(0)))
    assert "scale=unset" in repr(calc)
    calc(torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]]) * 127.5)
    text = repr(calc)
    assert "dtype=int8" in text and "qscheme=symmetric" in text and "PerChannel(axis=0)" in text
    assert "export_mode=False" in text and "scale=[1, 2, 3, 4, ...]" in text and "zero_point=[0, 0, 0, 0, ...]" in text


class _Work:
    def __init__(self, waits: list[object]) -> None:
        self.waits = waits

    def wait(self, timeout: object = None) -> bool:
        self.waits.append(timeout)
        return True


class _ThreadRanks:
    """Simulated ranks: one thread per rank, ``torch.distributed`` collectives replaced by a lock-step exchange.

    Reductions run in rank order; every collective is recorded per rank (``calls``), as is every ``wait``
    timeout of an ``async_op`` collective (``waits``). A rank that skips a collective makes the barrier time out.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.calls: list[list[str]] = [[] for _ in range(world)]
        self.waits: list[object] = []
        self._barrier = threading.Barrier(world, timeout=20)
        self._slots: list[Tensor | None] = [None] * world
        self._local = threading.local()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> _ThreadRanks:
        import torch.distributed as dist

        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: self.world)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        return self

    def _exchange(self, tensor: Tensor) -> list[Tensor]:
        self._slots[self._local.rank] = tensor.detach().clone()
        self._barrier.wait()
        values = [t for t in self._slots if t is not None]
        self._barrier.wait()
        return values

    def all_reduce(self, tensor: Tensor, op: object = None, group: object | None = None, async_op: bool = False):  # noqa: ANN201
        import torch.distributed as dist

        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}[op]
        self.calls[self._local.rank].append(name)
        values = self._exchange(tensor)
        out = values[0].clone()
        for value in values[1:]:
            out = {"sum": out + value, "min": torch.minimum(out, value), "max": torch.maximum(out, value)}[name]
        tensor.copy_(out)
        return _Work(self.waits) if async_op else None

    def all_gather(self, out: list[Tensor], tensor: Tensor, group: object | None = None, async_op: bool = False):  # noqa: ANN201
        self.calls[self._local.rank].append("gather")
        for slot, value in zip(out, self._exchange(tensor), strict=True):
            slot.copy_(value)
        return _Work(self.waits) if async_op else None

    def run(self, fn: Callable[[int], object]) -> list[object]:
        """Run ``fn(rank)`` on every simulated rank; returns each rank's result or raised exception."""
        results: list[object] = [None] * self.world

        def target(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except Exception as exc:  # noqa: BLE001 - returned to the test
                results[rank] = exc

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return results


def _ema(per_channel: bool = True) -> MovingAverageQParamsCalculator:
    granularity = PerChannel(0) if per_channel else PerTensor()
    spec = QuantizationSpec(
        dtype="int8", granularity=granularity, qparams_calculator="moving_average", averaging_constant=0.5
    )
    return MovingAverageQParamsCalculator(spec)


def _weighted(values: list[Tensor], weights: list[int]) -> Tensor:
    """The documented rule, written out: Σ w·m / Σ w in float64, rank order, cast to float32."""
    num = sum((v.double() * w for v, w in zip(values, weights, strict=True)), torch.zeros_like(values[0]).double())
    return (num / sum(weights)).float()


def test_moving_average_sync_is_batch_weighted_and_an_empty_rank_adopts_the_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ranks = _ThreadRanks(3).install(monkeypatch)
    batches = {0: [X * 2.0, X - 1.0], 1: [X * 0.5 + 0.25], 2: []}  # rank 2 saw no data
    calcs = [_ema() for _ in range(3)]
    for rank, xs in batches.items():
        for x in xs:
            calcs[rank].observe(x)
    assert [c.batches_since_sync for c in calcs] == [2, 1, 0]
    assert calcs[2].running_min.shape == (0,)
    before = [(c.running_min.clone(), c.running_max.clone()) for c in calcs[:2]]

    assert ranks.run(lambda r: calcs[r].sync_statistics()) == [None] * 3
    expected_min = _weighted([b[0] for b in before], [2, 1])
    expected_max = _weighted([b[1] for b in before], [2, 1])
    last_min = torch.minimum(X.amin(1) - 1.0, X.amin(1) * 0.5 + 0.25)  # last batches of ranks 0 and 1
    for calc in calcs:
        assert torch.equal(calc.running_min, expected_min) and torch.equal(calc.running_max, expected_max)
        assert torch.equal(calc.range_calculator.min_val, last_min)  # the last-batch range is merged too
        assert calc.batches_since_sync == 0
    assert ranks.calls[2] == ["max", "gather", "max", "min", "max"]  # shapes, EMA, then the last-batch range

    # No batch since the merge: Σ w = 0, nothing changes (a repeated merge is a no-op).
    assert ranks.run(lambda r: calcs[r].sync_statistics(only_order_dependent=True)) == [None] * 3
    assert all(torch.equal(c.running_min, expected_min) for c in calcs)


def test_moving_average_rank_weights_follow_the_batch_counter() -> None:
    calc = _ema(per_channel=False)
    calc.observe(X)
    calc.observe(X)
    assert calc.batches_since_sync == 2
    calc.reset_statistics()
    assert calc.batches_since_sync == 0
    calc(X)
    calc.set_export_mode(True)
    calc(X)  # frozen: observes nothing
    assert calc.batches_since_sync == 1


def test_global_and_static_minmax_sync_with_an_empty_rank_and_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from coreai_opt.quantization.collectives import collective_timeout

    ranks = _ThreadRanks(3).install(monkeypatch)
    data = {0: X, 1: X * -2.0}
    glob = [GlobalMinMaxQParamsCalculator(QuantizationSpec(dtype="int8", granularity=PerChannel(0),
                                                           qparams_calculator="global_minmax")) for _ in range(3)]
    static = [StaticQParamsCalculator(QuantizationSpec(dtype="int8", granularity=PerChannel(0))) for _ in range(3)]
    for rank, x in data.items():
        glob[rank].observe(x)
        static[rank].observe(x)

    def sync(rank: int) -> None:
        with collective_timeout(5.0):
            glob[rank].sync_statistics()
            static[rank].sync_statistics()

    assert ranks.run(sync) == [None] * 3
    mins = torch.minimum(X.amin(1), (X * -2.0).amin(1))
    maxs = torch.maximum(X.amax(1), (X * -2.0).amax(1))
    for rank in range(3):
        assert torch.equal(glob[rank].running_min, mins) and torch.equal(glob[rank].running_max, maxs)
        assert torch.equal(static[rank].observed_range()[0], mins)
        assert torch.equal(static[rank].observed_range()[1], maxs)
    assert static[2].commit().scale.tolist() == static[0].commit().scale.tolist()
    assert ranks.waits and set(ranks.waits) == {timedelta(seconds=5)}


def test_sync_without_data_anywhere_and_order_dependent_only(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _ThreadRanks(2).install(monkeypatch)
    glob = [GlobalMinMaxQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="global_minmax"))
            for _ in range(2)]
    assert ranks.run(lambda r: glob[r].sync_statistics()) == [None] * 2
    assert all(g.running_min.numel() == 0 and not g.has_statistics for g in glob)  # nothing to merge anywhere
    calls = [len(c) for c in ranks.calls]
    assert ranks.run(lambda r: glob[r].sync_statistics(only_order_dependent=True)) == [None] * 2
    assert [len(c) for c in ranks.calls] == calls  # not order-dependent: returns without a collective
    dynamic = DynamicQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="dynamic"))
    dynamic.sync_statistics()  # stateless: nothing to merge, no collective


def test_sync_raises_on_every_rank_when_qparam_shapes_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _ThreadRanks(2).install(monkeypatch)
    calcs = [_ema(), _ema()]
    calcs[0].observe(X)  # 2 channels
    calcs[1].observe(torch.randn(3, 4))  # 3 channels
    results = ranks.run(lambda r: calcs[r].sync_statistics())
    assert all(isinstance(e, ValueError) and "different qparam shapes" in str(e) for e in results)


def test_histogram_static_sync_equals_single_process_with_an_empty_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _ThreadRanks(3).install(monkeypatch)
    spec = QuantizationSpec(dtype="int8", granularity=PerChannel(0), range_calculator="percentile", num_bins=256)
    shards = [torch.randn(2, 64) * 3.0, torch.randn(2, 64) * 40.0]
    calcs = [StaticQParamsCalculator(spec) for _ in range(3)]
    for calc, shard in zip(calcs, shards, strict=False):
        calc.observe(shard)
    whole = StaticQParamsCalculator(spec)
    whole.observe(torch.cat(shards, dim=1))
    assert ranks.run(lambda r: calcs[r].sync_statistics()) == [None] * 3
    for calc in calcs:
        assert torch.equal(calc.range_calculator.histogram.counts, whole.range_calculator.histogram.counts)
        assert torch.equal(calc.commit().scale, whole.commit().scale)


@pytest.mark.parametrize("key", ["global_minmax", "moving_average"])
def test_running_calculator_ignores_an_all_nan_batch_with_a_warning(key):
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", qparams_calculator=key)
    clean = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    dirty = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    x = torch.linspace(-1.0, 3.0, 17)
    clean.observe(x)
    clean.observe(x * 2)
    dirty.observe(x)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        dirty.observe(torch.full((5,), float("nan")))
    dirty.observe(x * 2)
    assert torch.equal(clean.commit().scale, dirty.commit().scale)
    assert torch.equal(clean.zero_point, dirty.zero_point)
