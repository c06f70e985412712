from __future__ import annotations

import warnings

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


class _FakeDist:
    """Stands in for torch.distributed with one simulated peer rank holding ``peer`` values."""

    def __init__(self, peer: dict[str, Tensor]) -> None:
        self.peer = peer
        self.calls: list[str] = []

        class ReduceOp:
            SUM, MIN, MAX = "sum", "min", "max"

        self.ReduceOp = ReduceOp

    def get_world_size(self, group: object | None = None) -> int:
        return 2

    def all_reduce(self, tensor: Tensor, op: str, group: object | None = None) -> None:
        other = self.peer[f"{op}:{len(self.calls)}"]
        self.calls.append(op)
        merged = {"sum": tensor + other, "min": torch.minimum(tensor, other), "max": torch.maximum(tensor, other)}[op]
        tensor.copy_(merged)


def test_sync_statistics_merges_running_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    ema = MovingAverageQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="moving_average"))
    ema.observe(torch.tensor([-1.0, 3.0]))
    fake = _FakeDist({"sum:0": torch.tensor(-3.0), "sum:1": torch.tensor(5.0)})
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    monkeypatch.setattr(dist, "get_world_size", fake.get_world_size)
    monkeypatch.setattr(dist, "ReduceOp", fake.ReduceOp)
    ema.sync_statistics()
    assert (ema.running_min.item(), ema.running_max.item()) == (-2.0, 4.0)  # mean of the two ranks

    glob = GlobalMinMaxQParamsCalculator(QuantizationSpec(dtype="int8", qparams_calculator="global_minmax"))
    glob.observe(torch.tensor([-1.0, 3.0]))
    fake2 = _FakeDist({"min:0": torch.tensor(-3.0), "max:1": torch.tensor(2.0)})
    monkeypatch.setattr(dist, "all_reduce", fake2.all_reduce)
    glob.sync_statistics()
    assert (glob.running_min.item(), glob.running_max.item()) == (-3.0, 3.0)

    static = StaticQParamsCalculator(QuantizationSpec(dtype="int8"))
    static.observe(torch.tensor([-1.0, 3.0]))
    fake3 = _FakeDist({"min:0": torch.tensor(-3.0), "max:1": torch.tensor(2.0)})
    monkeypatch.setattr(dist, "all_reduce", fake3.all_reduce)
    static.sync_statistics()
    assert fake3.calls == ["min", "max"]
    assert static.commit().scale.item() == torch.tensor(3 / 127.5).item()
