"""MSERangeCalculator: the chosen clipping range lowers the real quantization error."""

from __future__ import annotations

import pytest
import torch

from coreai_opt.quantization.ranges.mse_range_calculator import MSERangeCalculator, fake_quantize_values
from coreai_opt.quantization.spec.dtypes import get_dtype_info
from coreai_opt.quantization.spec.granularity import PerChannel, QuantizationScheme
from coreai_opt.quantization.spec.qparams_math import compute_qparams
from coreai_opt.quantization.spec.spec import QuantizationSpec


def _student_t(n: int, seed: int, dof: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi2 = (torch.randn(n, int(dof), generator=g) ** 2).sum(dim=1)
    return z / torch.sqrt(chi2 / dof)


def _quant_mse(x: torch.Tensor, lo, hi, dtype: str, qscheme: str, dim=None):
    """Mean squared fake-quantization error of the raw data (vectorised over ranges with ``dim=1``)."""
    info = get_dtype_info(dtype)
    qp = compute_qparams(lo, hi, info, qscheme)
    fq = fake_quantize_values(x.double(), qp.scale, qp.zero_point, info, QuantizationScheme(qscheme))
    err = (x.double() - fq) ** 2
    return float(err.mean()) if dim is None else err.mean(dim=dim)


@pytest.mark.parametrize(
    ("dtype", "qscheme", "max_ratio"),
    [
        # measured MSE (chosen / min-max / best factor on the raw data): 0.3596 / 0.4309 / 0.3584
        ("int8", "symmetric", 0.9),
        # 4.179 / 5.102 / 4.179
        ("int4", "symmetric", 0.9),
        # on |x| (one-sided, like a ReLU output): 0.1118 / 0.1154 / 0.1086
        ("uint8", "asymmetric", 0.99),
    ],
)
def test_mse_range_calculator_beats_minmax_on_heavy_tailed_data(dtype, qscheme, max_ratio):
    x = _student_t(50_000, seed=0)
    if qscheme == "asymmetric":
        x = x.abs()
    calc = MSERangeCalculator(dtype=dtype, qscheme=qscheme)
    for chunk in x.split(10_000):
        calc.update(chunk)
    lo, hi = calc.compute_range()
    mse_chosen = _quant_mse(x, lo, hi, dtype, qscheme)
    mse_minmax = _quant_mse(x, x.min(), x.max(), dtype, qscheme)
    # The same factor grid searched with the exact data instead of the 2048-bin histogram.
    factors = torch.linspace(0.01, 1.0, 100).unsqueeze(1)
    oracle = _quant_mse(x, factors * x.min(), factors * x.max(), dtype, qscheme, dim=1).min().item()
    assert float(hi) < 0.96 * float(x.max())
    assert mse_chosen < max_ratio * mse_minmax, (mse_chosen, mse_minmax)
    assert mse_chosen <= 1.06 * oracle, (mse_chosen, oracle)


def test_mse_range_calculator_keeps_full_range_on_uniform_data_per_channel():
    g = torch.Generator().manual_seed(1)
    x = torch.stack([_student_t(50_000, seed=2), torch.rand(50_000, generator=g) * 2 - 1], dim=1)
    calc = MSERangeCalculator(PerChannel(axis=1), dtype="int8")
    calc.update(x)
    lo, hi = calc.compute_range()
    factors = hi / x.max(dim=0).values
    # Heavy-tailed channel is clipped hard; the uniform channel has no tail worth clipping.
    assert factors[0] < 0.85 and factors[1] > 0.97, factors  # measured 0.78 and 1.0


class _SevenCandidates(MSERangeCalculator):
    num_candidates = 7
    min_factor = 0.2


def test_mse_range_calculator_candidate_errors_match_direct_computation():
    x = _student_t(5_000, seed=3)
    calc = _SevenCandidates(num_bins=256, dtype="int4")
    calc.update(x)
    factors, errors = calc.candidate_errors()
    hist = calc.histogram
    centres = (hist.bin_left_edges() + hist.bin_width()[:, None] / 2).clamp(hist.row_min, hist.row_max)[0]
    info = get_dtype_info("int4")
    for f, err in zip(factors.tolist(), errors[0].tolist(), strict=True):
        lo, hi = torch.tensor(f * float(hist.row_min)), torch.tensor(f * float(hist.row_max))
        qp = compute_qparams(lo, hi, info, "symmetric")
        q = torch.clamp(torch.round(centres / qp.scale.double()), -8, 7) * qp.scale.double()
        direct = float((hist.counts[0].double() * (centres - q) ** 2).sum())
        assert err == pytest.approx(direct, rel=1e-9)


def test_mse_range_calculator_float8_uses_cast_simulation():
    x = _student_t(20_000, seed=4, dof=1.0) * 100  # Cauchy-like: extreme outliers
    calc = MSERangeCalculator(dtype="float8_e4m3fn")
    calc.update(x)
    factors, errors = calc.candidate_errors()
    hist = calc.histogram
    centres = (hist.bin_left_edges() + hist.bin_width()[:, None] / 2).clamp(hist.row_min, hist.row_max)[0]
    scale = float(torch.maximum(-hist.row_min, hist.row_max)) / 448.0
    cast = (centres / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale
    direct = float((hist.counts[0].double() * (centres - cast) ** 2).sum())
    assert float(errors[0, -1]) == pytest.approx(direct, rel=1e-6)
    lo, hi = calc.compute_range()
    assert _quant_mse(x, lo, hi, "float8_e4m3fn", "symmetric") <= _quant_mse(
        x, x.min(), x.max(), "float8_e4m3fn", "symmetric"
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [(torch.zeros(100), (0.0, 0.0)), (torch.full((10,), -2.5), (-2.5, -2.5)), (torch.tensor([0.75]), (0.75, 0.75))],
    ids=["all_zero", "constant", "single_element"],
)
def test_mse_range_calculator_edge_cases(data, expected):
    calc = MSERangeCalculator()
    calc.update(data)
    lo, hi = calc.compute_range()
    assert (float(lo), float(hi)) == expected


def test_mse_range_calculator_from_spec_reads_dtype_and_scheme():
    spec = QuantizationSpec(dtype="uint4", qscheme="asymmetric", range_calculator="mse", num_bins=1024)
    calc = MSERangeCalculator.from_spec(spec)
    assert calc.dtype_info.name == "uint4" and calc.qscheme is QuantizationScheme.ASYMMETRIC and calc.num_bins == 1024


def test_mse_range_calculator_rejects_bad_arguments_and_bad_subclass_knobs():
    with pytest.raises(ValueError, match="num_candidates=1 must be an int >= 2"):
        type("OneCandidate", (MSERangeCalculator,), {"num_candidates": 1})
    with pytest.raises(ValueError, match="min_factor=1.5 must be in"):
        type("FactorAboveOne", (MSERangeCalculator,), {"min_factor": 1.5})
    with pytest.raises(ValueError, match="symmetric"):
        MSERangeCalculator(dtype="float8_e5m2", qscheme="asymmetric")
