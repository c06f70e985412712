"""Weight-rounding algorithms: exact integers, error against round-to-nearest, integer zero points, determinism."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from coreai_opt.quantization.rounding import GPTQClipSearchRounding, GPTQRounding, HQQRounding, MSERounding
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.weight_rounding import WEIGHT_ROUNDING, RoundedWeight, RTNRounding
from coreai_opt.quantization.spec import FakeQuantize, PerBlock, PerChannel, PerTensor, QuantizationSpec


def _spec(rounding: str | None, qscheme: str = "symmetric", granularity: object = None) -> QuantizationSpec:
    return QuantizationSpec(dtype="int4", qscheme=qscheme, weight_rounding=rounding,
                            granularity=granularity or PerBlock(axis=1, block_size=32))


def _dequant(r: RoundedWeight, granularity: object, like: Tensor) -> Tensor:
    q = r.q.float()
    return (q - granularity.expand(r.zero_point.float(), q)) * granularity.expand(r.scale, q)


def _correlated_case(seed: int = 0) -> tuple[Tensor, Tensor, InputStatistics]:
    """A ``[64, 128]`` weight and inputs with strongly correlated channels and uneven magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(16, 128, generator=gen)
    x = torch.randn(2048, 16, generator=gen) @ mixing + 0.05 * torch.randn(2048, 128, generator=gen)
    x = x * torch.linspace(0.2, 3.0, 128)
    w = torch.randn(64, 128, generator=gen) * 0.1
    stats = InputStatistics(hessian=True)
    for chunk in x.split(512):
        stats.update(chunk)
    return w, x, stats


def _output_mse(x: Tensor, w: Tensor, w_hat: Tensor) -> float:
    return float((x @ w.T - x @ w_hat.T).square().mean())


def test_rtn_full_signed_range_maps_the_largest_magnitude_to_minus_eight() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25, 0.75], [2.0, -1.0, 0.5, -1.5]])
    spec = _spec("rtn", granularity=PerBlock(axis=1, block_size=4))
    result = RTNRounding(spec).round_weight(w, None)
    assert result.q.tolist() == [[4, -8, 2, 6], [-8, 4, -2, 6]]
    assert result.scale.tolist() == [[0.125], [-0.25]]  # signed scale vmax / -8
    assert result.zero_point.tolist() == [[0], [0]]
    assert torch.equal(_dequant(result, spec.granularity, w), w)  # every value here is on the grid


def test_rtn_asymmetric_uses_min_max_with_integer_zero_point() -> None:
    w = torch.tensor([[-0.5, 1.0, 0.0, 0.25]])
    spec = _spec("rtn", "asymmetric", PerBlock(axis=1, block_size=4))
    result = RTNRounding(spec).round_weight(w, None)
    assert result.scale.item() == pytest.approx(0.1)  # (1.0 - (-0.5)) / 15
    assert result.zero_point.item() == -3  # -8 - round(-0.5 / 0.1)
    assert result.q.tolist() == [[-8, 7, -3, -1]]  # 0.25 / 0.1 = 2.5 rounds half to even: 2


def test_rtn_full_range_lowers_weight_error_by_more_than_ten_percent_against_the_min_max_quantizer() -> None:
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    errors = {}
    for rounding in (None, "rtn"):
        fq = FakeQuantize(_spec(rounding))
        fq.observe(w)
        fq.commit()
        fq.enable_observer(False)
        errors[rounding] = float((fq(w) - w).square().mean())
    assert errors["rtn"] / errors[None] < 0.9  # 16 levels with an exact extreme vs 15.5 levels (max / 7.5)


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_gptq_output_error_is_less_than_a_third_of_rtn_on_correlated_inputs(qscheme: str) -> None:
    w, x, stats = _correlated_case()
    spec = _spec("gptq", qscheme)
    rtn = _output_mse(x, w, _dequant(RTNRounding(spec).round_weight(w, None), spec.granularity, w))
    gptq = _output_mse(x, w, _dequant(GPTQRounding(spec).round_weight(w, stats), spec.granularity, w))
    assert gptq / rtn < 1 / 3


def test_gptq_with_activation_order_and_per_channel_scales_beats_rtn() -> None:
    w, x, stats = _correlated_case(2)
    spec = _spec("gptq", granularity=PerChannel(axis=0))

    class ActOrder(GPTQRounding):
        act_order = True

    rtn = _output_mse(x, w, _dequant(RTNRounding(spec).round_weight(w, None), spec.granularity, w))
    ordered = _output_mse(x, w, _dequant(ActOrder(spec).round_weight(w, stats), spec.granularity, w))
    assert ordered / rtn < 1 / 3


def test_weighted_mse_search_lowers_output_error_by_seven_percent_against_rtn() -> None:
    w, x, stats = _correlated_case(3)
    spec = _spec("mse", "asymmetric")
    rtn = _output_mse(x, w, _dequant(RTNRounding(spec).round_weight(w, None), spec.granularity, w))
    mse = _output_mse(x, w, _dequant(MSERounding(spec).round_weight(w, stats), spec.granularity, w))
    assert mse / rtn < 0.93  # measured 0.902


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_hqq_has_integer_zero_points_in_range_and_three_percent_lower_weight_error_than_rtn(qscheme: str) -> None:
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    w[::7, ::11] *= 6.0  # outliers, where a robust fit pays off
    spec = _spec("hqq", qscheme)
    result = HQQRounding(spec).round_weight(w, None)
    assert result.zero_point.dtype == torch.int32
    assert int(result.zero_point.min()) >= -8 and int(result.zero_point.max()) <= 7
    rtn = RTNRounding(spec).round_weight(w, None)
    hqq_err = float((_dequant(result, spec.granularity, w) - w).square().mean())
    rtn_err = float((_dequant(rtn, spec.granularity, w) - w).square().mean())
    assert hqq_err / rtn_err < 0.97  # measured 0.941 (symmetric), 0.952 (asymmetric)


def test_gptq_with_hessian_weighted_clip_search_has_less_than_a_third_of_rtn_output_error() -> None:
    w, x, stats = _correlated_case(7)
    spec = _spec("gptq_mse", "asymmetric")
    rtn = _output_mse(x, w, _dequant(RTNRounding(spec).round_weight(w, None), spec.granularity, w))
    searched = _output_mse(x, w, _dequant(GPTQClipSearchRounding(spec).round_weight(w, stats), spec.granularity, w))
    assert searched / rtn < 1 / 3  # on this case plain GPTQ is lower still (0.059 vs 0.070): no claim either way


@pytest.mark.parametrize("key", ["rtn", "mse", "hqq", "gptq", "gptq_mse"])
def test_every_algorithm_is_deterministic(key: str) -> None:
    w, _, stats = _correlated_case(5)
    spec = _spec(key, "asymmetric")
    first = WEIGHT_ROUNDING.get_class(key)(spec).round_weight(w, stats)
    second = WEIGHT_ROUNDING.get_class(key)(spec).round_weight(w.clone(), stats)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(axis=0), PerBlock(axis=1, block_size=16)])
@pytest.mark.parametrize("key", ["rtn", "mse", "hqq", "gptq", "gptq_mse"])
def test_fake_quantize_output_is_exactly_the_algorithms_integers_times_scale(key: str, granularity: object) -> None:
    w, _, stats = _correlated_case(6)
    fq = FakeQuantize(_spec(key, "asymmetric", granularity))
    if fq.rounding.statistics is not None:
        fq.rounding.statistics.update(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    fq.observe(w)
    fq.commit()
    fq.enable_observer(False)
    rounding = fq.rounding
    expected = (rounding.qweight.float() - granularity.expand(rounding.zero_point.float(), w)) * granularity.expand(
        rounding.scale, w)
    assert torch.equal(fq(w), expected)
    assert torch.equal(fq.calculator.scale, rounding.scale)
    fq.set_export_mode(True)
    assert torch.equal(fq(w), expected)


def test_a_changed_weight_is_refused_instead_of_using_the_stale_rounding() -> None:
    w = torch.randn(8, 32)
    fq = FakeQuantize(_spec("hqq", "asymmetric"))
    fq.observe(w)
    fq.commit()
    fq.enable_observer(False)
    changed = w.clone()
    changed[0, 0] += 1e-6
    with pytest.raises(RuntimeError, match="the weight changed since it was rounded"):
        fq(changed)


def test_user_registered_rounding_is_used_through_the_spec_key() -> None:
    @WEIGHT_ROUNDING.register("test_floor")
    class FloorRounding(RTNRounding):
        def round_weight(self, weight: Tensor, statistics: InputStatistics | None) -> RoundedWeight:
            base = super().round_weight(weight, statistics)
            return base._replace(q=torch.full_like(base.q, -1))

    try:
        fq = FakeQuantize(_spec("test_floor"))
        w = torch.randn(4, 32)
        fq.observe(w)
        fq.commit()
        fq.enable_observer(False)
        assert torch.equal(fq(w), -fq.calculator.scale.repeat_interleave(32, dim=1))
    finally:
        WEIGHT_ROUNDING.unregister("test_floor")


def test_weight_rounding_rejects_float_dtypes_and_dynamic_qparams_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="integer dtype of at most 8 bits"):
        QuantizationSpec(dtype="float8_e4m3fn", weight_rounding="rtn")
    with pytest.raises(ValueError, match="qparams_calculator='static'"):
        QuantizationSpec(dtype="int4", qparams_calculator="moving_average", weight_rounding="rtn")
    with pytest.raises(ValueError, match="gptq"):
        QuantizationSpec(dtype="int4", weight_rounding="gtpq")


def test_input_statistics_hessian_is_two_xtx_over_n_and_skips_non_finite_rows() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [float("nan"), 0.0]])
    stats = InputStatistics(hessian=True)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        stats.update(x)
    finite = x[:2]
    assert torch.equal(stats.hessian_matrix(), 2.0 * finite.T @ finite / 2)
    assert stats.second_moment().tolist() == [5.0, 2.5]
    assert [t.tolist() for t in stats.compute_range()] == [[1.0, -1.0], [3.0, 2.0]]
    stats.reset()
    assert not stats.has_statistics and stats.xtx.numel() == 0


@pytest.mark.parametrize("sizes", [(3, 5, 2), (30, 40, 1, 7)])  # 10 rows < 64 channels; 78 rows >= 64
def test_input_statistics_keep_rows_below_d_and_form_the_same_hessian_bit_for_bit(sizes: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 64, generator=gen) * 3 for n in sizes]
    stats = InputStatistics(hessian=True)
    expected = torch.zeros(64, 64)
    for i, batch in enumerate(batches):
        stats.update(batch)
        expected.addmm_(batch.T, batch)  # the per-batch accumulation the Hessian was always formed by
        seen = sum(sizes[:i + 1])
        assert (stats.rows.shape[0], stats.xtx.numel()) == ((seen, 0) if seen < 64 else (0, 64 * 64))
    kept = stats.rows.numel() * 4
    assert kept in (0, sum(sizes) * 64 * 4)  # the rows' bytes while n < d: 2.5 kB instead of the 16 kB matrix
    assert torch.equal(stats.hessian_matrix(), expected * (2.0 / sum(sizes)))
    with stats.consumed():
        assert torch.equal(stats.hessian_matrix(), expected * (2.0 / sum(sizes)))
    assert stats.rows.numel() == 0 and stats.xtx.numel() == 0


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("weighted", [False, True])
def test_mse_search_in_row_chunks_gives_the_whole_tensor_result_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                                           qscheme: str, weighted: bool) -> None:
    from coreai_opt.quantization.rounding import mse_clip_search as rounding_mse

    torch.manual_seed(3)
    rows = torch.randn(203, 32) * torch.rand(203, 1) * 3
    rows[::7] *= 50  # rows with outliers take more refinement rounds than the rest
    importance = torch.rand(203, 32) if weighted else None
    spec = _spec("mse", qscheme, PerBlock(1, 32))
    whole = rounding_mse.search_rows(rows, importance, spec, MSERounding.grid, MSERounding.refinements)
    monkeypatch.setattr(rounding_mse, "SEARCH_CHUNK_ELEMENTS", 5 * 32)  # 41 chunks of 5 rows (the last of 3)
    calls: list[int] = []
    search_chunk = rounding_mse._search_chunk
    monkeypatch.setattr(rounding_mse, "_search_chunk", lambda r, *a: calls.append(r.shape[0]) or search_chunk(r, *a))
    chunked = rounding_mse.search_rows(rows, importance, spec, MSERounding.grid, MSERounding.refinements)
    assert calls == [5] * 40 + [3]
    for a, b in zip(whole, chunked, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
