"""Overflow-safe qparams: ranges near float32's limit give finite grids, everything else is bit-identical to before.

``_float32_reference`` is the plain-float32 formula the spec layer used before overflow safety (kept here verbatim
as the regression reference): on normal ranges the new ``compute_qparams`` must reproduce it bit for bit.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.errors import QParamsRangeError
from coreai_opt.quantization.spec import (
    SCALE_EPS,
    FakeQuantize,
    QParams,
    QuantizationScheme,
    QuantizationSpec,
    compute_qparams,
    get_dtype_info,
    quant_range,
)
from coreai_opt.quantization.spec import qparams_calculator as calculator_module
from coreai_opt.quantization.spec.dtypes import QuantDtype
from coreai_opt.quantization.spec.qparams_math import FLOAT32_MAX, range_limit

INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int4", "uint4")
FLOAT_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCHEMES = ("symmetric", "symmetric_with_clipping", "asymmetric")
CASES = [(d, s) for d in INT_DTYPES for s in SCHEMES] + [(d, s) for d in FLOAT_DTYPES for s in SCHEMES[:2]]


def _float32_reference(min_val: torch.Tensor, max_val: torch.Tensor, dtype_info: QuantDtype, qscheme: str) -> QParams:
    """The pre-overflow-safety formula (float32 throughout, ±inf bounds as 0)."""
    scheme = QuantizationScheme(qscheme)
    mn = min_val.detach().float()
    mx = max_val.detach().float()
    mn = torch.where(torch.isinf(mn), torch.zeros_like(mn), mn)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    min_neg, max_pos = torch.clamp(mn, max=0.0), torch.clamp(mx, min=0.0)
    max_abs = torch.maximum(-min_neg, max_pos)
    qmin, qmax = quant_range(dtype_info, scheme)
    if dtype_info.is_float:
        return QParams(torch.clamp(max_abs / float(dtype_info.quant_max), min=SCALE_EPS), None, None)
    if scheme is QuantizationScheme.ASYMMETRIC:
        scale = torch.clamp((max_pos - min_neg) / float(qmax - qmin), min=SCALE_EPS)
        zero_point = torch.clamp(qmin - torch.round(min_neg / scale), qmin, qmax).to(torch.int32)
    else:
        scale = torch.clamp(max_abs / ((qmax - qmin) / 2.0), min=SCALE_EPS)
        zero_point = torch.full_like(scale, (qmin + qmax + 1) // 2, dtype=torch.int32)
    return QParams(scale, zero_point, (qmin - zero_point).float() * scale)


def _random_ranges(generator: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranges over 80 decades (log-uniform magnitudes), one-sided, zero-width and inf (empty) rows included."""
    magnitude = torch.pow(10.0, torch.empty(count, dtype=torch.float64).uniform_(-40, 37, generator=generator))
    low = -(magnitude * torch.rand(count, generator=generator, dtype=torch.float64)).float()
    high = (magnitude * torch.rand(count, generator=generator, dtype=torch.float64)).float()
    low[::17], high[::19] = 0.0, 0.0  # one-sided
    low[::23] = high[::23] = 0.0  # all-zero
    low[::29], high[::29] = float("inf"), float("-inf")  # a row that saw no finite value
    return low, high


@pytest.mark.parametrize(("dtype", "scheme"), CASES)
def test_normal_ranges_give_bit_identical_qparams_to_the_float32_formula(dtype: str, scheme: str) -> None:
    """4000 random ranges per case (32 cases): scale, zero point and minval are torch.equal to the old formula."""
    info = get_dtype_info(dtype)
    low, high = _random_ranges(torch.Generator().manual_seed(zlib.crc32(f"{dtype}/{scheme}".encode())), 4000)
    new, old = compute_qparams(low, high, info, scheme), _float32_reference(low, high, info, scheme)
    assert torch.equal(new.scale, old.scale)
    if old.zero_point is None:
        assert new.zero_point is None and new.minval is None
    else:
        assert torch.equal(new.zero_point, old.zero_point)
        assert torch.equal(new.minval, old.minval)


@pytest.mark.parametrize(("dtype", "scheme"), CASES)
@pytest.mark.parametrize("bounds", [(-3e38, 3e38), (-FLOAT32_MAX, FLOAT32_MAX), (0.0, FLOAT32_MAX),
                                    (-FLOAT32_MAX, 0.0), (-FLOAT32_MAX, 1.0)])
def test_ranges_near_float32_max_give_finite_scales_and_a_finite_grid(dtype: str, scheme: str,
                                                                      bounds: tuple[float, float]) -> None:
    info = get_dtype_info(dtype)
    low, high = torch.tensor(bounds[0]), torch.tensor(bounds[1])
    scale, zero_point, minval = compute_qparams(low, high, info, scheme)
    assert torch.isfinite(scale) and scale > 0
    if zero_point is None:
        assert torch.isfinite(scale * float(info.quant_max))
        return
    qmin, qmax = quant_range(info, scheme)
    levels = torch.arange(qmin, qmax + 1, dtype=torch.float32)
    grid = (levels - zero_point.float()) * scale
    assert torch.isfinite(grid).all() and torch.isfinite(minval)
    # exactly the ordinary formula applied to the range clamped to ±range_limit (checked 2^64 times smaller)
    limit = range_limit(info, scheme)
    small = compute_qparams(low.clamp(-limit, limit) * 2.0**-64, high.clamp(-limit, limit) * 2.0**-64, info, scheme)
    assert scale.item() == pytest.approx(small.scale.item() * 2.0**64, rel=1e-6)
    assert zero_point.item() == small.zero_point.item()


# range_limit / FLT_MAX: the grid's far end, |qmin - zp| or |qmax - zp| steps, must stay finite (less 2^-20)
LIMIT_RATIOS = {("int8", "symmetric"): 127.5 / 128, ("int8", "symmetric_with_clipping"): 1.0,
                ("uint8", "asymmetric"): 255 / 256, ("int4", "symmetric"): 7.5 / 8, ("uint4", "asymmetric"): 15 / 16,
                ("int16", "symmetric"): 32767.5 / 32768, ("float8_e4m3fn", "symmetric"): 1.0}


@pytest.mark.parametrize(("dtype", "scheme"), list(LIMIT_RATIOS))
def test_range_limit_is_the_largest_bound_whose_grid_fits_float32(dtype: str, scheme: str) -> None:
    assert range_limit(get_dtype_info(dtype), scheme) == pytest.approx(FLOAT32_MAX * LIMIT_RATIOS[dtype, scheme],
                                                                       rel=2e-6)


def test_the_probe_range_of_plus_minus_3e38_gives_the_float64_scale() -> None:
    """Before: ``max - min`` overflowed float32, scale = inf, NaN outputs. Now: the exactly rounded 6e38 / 255."""
    scale, zero_point, minval = compute_qparams(torch.tensor(-3e38), torch.tensor(3e38), get_dtype_info("uint8"),
                                                "asymmetric")
    expected = torch.tensor((float(torch.tensor(3e38)) * 2) / 255.0, dtype=torch.float64).float()
    assert scale.item() == expected.item() and zero_point.item() == 128
    assert minval.item() == pytest.approx(-3e38, rel=4e-3)


def test_float64_histogram_bounds_above_float32_max_are_clamped_not_zeroed() -> None:
    """A power-of-two histogram edge of 2**128 used to become inf in float32 and then 0 (scale = eps)."""
    scale, _, _ = compute_qparams(torch.tensor(-(2.0**128), dtype=torch.float64),
                                  torch.tensor(2.0**128, dtype=torch.float64), get_dtype_info("int8"), "symmetric")
    assert scale.item() > 2e36 and torch.isfinite(scale)


def _calibrated_fake_quantize(spec: QuantizationSpec, data: torch.Tensor) -> FakeQuantize:
    fq = FakeQuantize(spec)
    fq.set_name("probe.output")
    fq.enable_fake_quant(False)
    fq(data)
    fq.commit()
    fq.enable_observer(False)
    fq.enable_fake_quant(True)
    return fq


@pytest.mark.parametrize("range_calculator", ["minmax", "percentile"])
def test_fake_quantize_calibrated_on_plus_minus_3e38_outputs_finite_values_within_half_a_step(
        range_calculator: str) -> None:
    data = torch.tensor([-3e38, -1e38, 0.0, 2e38, 3e38])
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", range_calculator=range_calculator,
                            percentile=100.0)
    fq = _calibrated_fake_quantize(spec, data)
    out = fq(data)
    scale = float(fq.calculator.scale)
    assert torch.isfinite(out).all()
    assert float((out.double() - data.double()).abs().max()) <= 0.5 * scale * (1 + 1e-6) + 1e-6 * 3e38


def test_nan_statistics_at_commit_raise_naming_the_quantizer() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.set_name("encoder.0.output")
    fq.calculator.range_calculator.min_val = torch.tensor([float("nan")])
    fq.calculator.range_calculator.max_val = torch.tensor([1.0])
    fq.calculator.range_calculator.__dict__["_all_finite_for"] = fq.calculator.range_calculator.min_val
    with pytest.raises(QParamsRangeError, match=r"^encoder\.0\.output: compute_qparams got NaN in min_val"):
        fq.calculator.commit()
    assert not fq.calculator.has_qparams


def test_a_scale_float32_cannot_hold_is_refused_at_commit_and_nothing_is_stored(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    fq = _calibrated_fake_quantize(QuantizationSpec(dtype="int8"), torch.tensor([-1.0, 1.0]))
    before = fq.calculator.scale.clone()

    def infinite(*args: object) -> QParams:
        return QParams(torch.tensor(float("inf")), torch.tensor(0, dtype=torch.int32), torch.tensor(float("-inf")))
    monkeypatch.setattr(calculator_module, "compute_qparams", infinite)
    fq.calculator.observe(torch.tensor([-2.0, 2.0]))
    with pytest.raises(QParamsRangeError,
                       match=r"probe\.output: the range \[-2\.0, 2\.0\] gives scale inf.*float_range"):
        fq.calculator.commit()
    assert torch.equal(fq.calculator.scale, before)


def test_float_range_beyond_float32_is_refused_by_the_spec() -> None:
    with pytest.raises(ValueError, match=r"float_range end -1e\+300 does not fit float32"):
        QuantizationSpec(dtype="int8", float_range=(-1e300, 1.0))


def test_calibrate_and_convert_on_plus_minus_3e38_give_finite_input_qparams() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    data = [torch.tensor([[-3e38, 3e38, 0.0, 1.0]])]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    scales = {fq.name: fq.calculator.scale for _, fq in fake_quantizers(converted)}
    input_scale = next(v for k, v in scales.items() if k.endswith(".input"))
    assert torch.isfinite(input_scale) and input_scale.item() == pytest.approx(6e38 / 255, rel=1e-6)
    assert all(bool(torch.isfinite(v).all()) for v in scales.values())


@pytest.mark.parametrize(("dtype", "scheme"), list(itertools.islice(CASES, 0, None, 4)))
def test_per_channel_rows_mixing_normal_and_extreme_ranges_only_change_the_extreme_rows(dtype: str,
                                                                                         scheme: str) -> None:
    info = get_dtype_info(dtype)
    low = torch.tensor([-1.0, -3.3e38, -0.25, -FLOAT32_MAX])
    high = torch.tensor([3.0, 3.3e38, 0.5, FLOAT32_MAX])
    new, old = compute_qparams(low, high, info, scheme), _float32_reference(low, high, info, scheme)
    normal = torch.tensor([True, False, True, False])
    assert torch.equal(new.scale[normal], old.scale[normal])
    assert torch.isfinite(new.scale).all()
