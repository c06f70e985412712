"""EntropyRangeCalculator: KL-divergence thresholds, checked against a per-candidate reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coreai_opt.quantization.ranges.entropy_range_calculator import (
    Q_FLOOR,
    EntropyRangeCalculator,
    kl_divergence_per_threshold,
)
from coreai_opt.quantization.spec.granularity import PerChannel
from coreai_opt.quantization.spec.spec import QuantizationSpec


def _reference_kl(h: np.ndarray, i: int, levels: int) -> float:
    """KL(P‖Q) of one candidate, built bin by bin as described in the TensorRT calibration talk."""
    p = h[:i].astype(np.float64).copy()
    p[-1] += h[i:].sum()
    m = i // levels
    q = np.zeros(i)
    for level in range(levels):
        start, stop = level * m, (level + 1) * m if level < levels - 1 else i
        nonzero = p[start:stop] > 0
        if nonzero.any():
            q[start:stop] = np.where(nonzero, h[start:stop].sum() / nonzero.sum(), 0.0)
    p, q = p / p.sum(), q / q.sum()
    q = np.where((p > 0) & (q == 0), Q_FLOOR, q)
    mask = p > 0
    return float((p[mask] * np.log(p[mask] / q[mask])).sum())


def _gaussian_with_outliers(outlier: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(100_000, generator=g), torch.full((10,), outlier)])


def test_kl_divergence_per_threshold_matches_bin_by_bin_reference():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (2, 300), generator=g)
    counts[:, 100:180] = 0  # empty stretch: levels with no reference mass
    counts[0, 250:] = 0
    counts[1, 299] = 7  # an isolated outlier bin
    candidates, kl = kl_divergence_per_threshold(counts, 16)
    assert candidates[0] == 16 and candidates[-1] == 300
    h = counts.numpy()
    for r in range(2):
        n_used = int(np.nonzero(h[r])[0].max()) + 1
        for c in range(0, candidates.numel(), 7):
            i = int(candidates[c])
            if i > n_used:
                assert math.isinf(float(kl[r, c]))
            else:
                assert float(kl[r, c]) == pytest.approx(_reference_kl(h[r], i, 16), rel=1e-9, abs=1e-12)


def test_entropy_range_calculator_clips_outliers_far_below_them():
    # Outliers at 50, 16384 bins (w = 1/128): the threshold lands in the Gaussian tail (measured T = 4.0).
    x = _gaussian_with_outliers(50.0)
    calc = EntropyRangeCalculator(num_bins=16384)
    calc.update(x)
    lo, hi = calc.compute_range()
    assert 2.5 < float(hi) < 6.0 and float(lo) >= float(x.min())
    # Default 2048 bins with outliers at 1000 (w = 1): the search cannot go below L·w = 128·1 (measured 128).
    x = _gaussian_with_outliers(1000.0)
    calc = EntropyRangeCalculator()
    calc.update(x)
    lo, hi = calc.compute_range()
    assert float(hi) == 128.0 and float(lo) == float(x.min())


def test_entropy_range_calculator_keeps_range_of_uniform_data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(100_000, generator=g) * 2 - 1
    calc = EntropyRangeCalculator()
    calc.update(x)
    lo, hi = calc.compute_range()
    # Clipping a flat distribution piles mass into the last bin: the KL minimum is at the observed max.
    assert float(hi) >= 0.98 * float(x.max()) and float(lo) <= 0.98 * float(x.min())


def test_entropy_range_calculator_num_levels_follow_dtype_and_scheme():
    assert EntropyRangeCalculator(dtype="int8").num_levels(one_sided=False) == 128
    assert EntropyRangeCalculator(dtype="int4").num_levels(one_sided=True) == 8
    assert EntropyRangeCalculator(dtype="uint8", qscheme="asymmetric").num_levels(one_sided=True) == 256
    assert EntropyRangeCalculator(dtype="uint8", qscheme="asymmetric").num_levels(one_sided=False) == 128
    assert EntropyRangeCalculator(dtype="float8_e4m3fn").num_levels(one_sided=False) == 128


def test_entropy_range_calculator_per_channel_rows_are_independent():
    g = torch.Generator().manual_seed(2)
    x = torch.stack([_gaussian_with_outliers(50.0, seed=3), torch.rand(100_010, generator=g)], dim=1)
    calc = EntropyRangeCalculator(PerChannel(axis=1), num_bins=16384, dtype="uint8", qscheme="asymmetric")
    calc.update(x)
    lo, hi = calc.compute_range()
    assert lo.shape == (2,)
    assert float(hi[0]) < 10.0  # outlier channel clipped
    assert float(hi[1]) >= 0.98 * float(x[:, 1].max()) and float(lo[1]) == float(x[:, 1].min())


@pytest.mark.parametrize(
    ("data", "expected"),
    [(torch.zeros(100), (0.0, 0.0)), (torch.full((10,), 6.5), (6.5, 6.5)), (torch.tensor([-0.5]), (-0.5, -0.5))],
    ids=["all_zero", "constant", "single_element"],
)
def test_entropy_range_calculator_edge_cases(data, expected):
    calc = EntropyRangeCalculator()
    calc.update(data)
    lo, hi = calc.compute_range()
    assert (float(lo), float(hi)) == expected


def test_entropy_range_calculator_from_spec_reads_fields():
    spec = QuantizationSpec(dtype="int4", range_calculator="entropy", num_bins=256)
    calc = EntropyRangeCalculator.from_spec(spec)
    assert calc.dtype_info.name == "int4" and calc.num_bins == 256
    calc.update(torch.randn(1000, generator=torch.Generator().manual_seed(4)))
    lo, hi = calc.compute_range()
    assert float(lo) < 0 < float(hi)
