"""An empty tensor carries no value: every statistic that observes one stays exactly as it was (issue 30, class 1).

Models meet empty tensors in calibration when a boolean mask selects nothing in some batch (an encoder-decoder
classifier picking its end-of-sequence hidden states). Before, ``aminmax`` raised ``IndexError: Expected
reduction dim 1 to have non-zero size`` from inside calibration.
"""

from __future__ import annotations

import pytest
import torch

from coreai_opt.api.algorithms.activation_stats import ChannelAbsMax
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.ops.dynamic_quantize_op import dynamic_quantize_dequantize
from coreai_opt.quantization.ranges.range_calculator import RANGE_CALCULATORS
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.spec import QPARAMS_CALCULATORS, PerChannel, PerTensor, QuantizationSpec

X = torch.tensor([[-1.0, 3.0, -2.0, 1.0], [0.5, 2.0, 0.0, 0.25]])
EMPTIES = [torch.empty(0, 4), torch.empty(2, 0), torch.empty(0)]


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_same_state(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("key", ["minmax", "percentile", "mse", "entropy"])
@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(1)])
def test_range_calculator_statistics_unchanged_by_empty_tensors(key: str, granularity: object) -> None:
    calc = RANGE_CALCULATORS.get_class(key).from_spec(QuantizationSpec(dtype="int8", granularity=granularity,
                                                                       range_calculator=key))
    for empty in EMPTIES:
        calc.update(empty)  # before any data: still nothing observed
    assert not calc.has_statistics
    calc.update(X)
    before, range_before = _state(calc), calc.compute_range()
    for empty in EMPTIES:
        calc.update(empty)
    _assert_same_state(before, _state(calc))
    for a, b in zip(range_before, calc.compute_range(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("key", ["static", "moving_average", "global_minmax"])
def test_qparams_calculator_ignores_empty_batches_exactly(key: str) -> None:
    spec = QuantizationSpec(dtype="int8", qscheme="asymmetric", qparams_calculator=key, averaging_constant=0.5)
    plain = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    with_empties = QPARAMS_CALCULATORS.get_class(key).from_spec(spec)
    for batch in (2 * X, X):
        plain.observe(batch)
        with_empties.observe(torch.empty(0, 4))
        with_empties.observe(batch)
        with_empties.observe(torch.empty(3, 0))
    assert with_empties.batches_since_sync == plain.batches_since_sync == 2
    for a, b in zip(plain.commit(), with_empties.commit(), strict=True):
        assert torch.equal(a, b)
    _assert_same_state(_state(plain), _state(with_empties))
    # moving_average with c = 0.5 over (2X, X): min = 0.5·(-4) + 0.5·(-2) = -3, max = 0.5·6 + 0.5·3 = 4.5
    if key == "moving_average":
        assert [t.tolist() for t in plain.observed_range()] == [-3.0, 4.5]


def test_quantizer_that_saw_only_empty_tensors_has_no_statistics_and_returns_them_unchanged() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="uint8", qscheme="asymmetric", qparams_calculator="global_minmax"))
    out = fq(torch.empty(0, 4))  # observer and fake quant on: nothing to observe, nothing to quantize
    assert out.shape == (0, 4)
    assert not fq.has_statistics and not fq.has_qparams


def test_dynamic_quantization_of_an_empty_tensor_is_empty() -> None:
    assert dynamic_quantize_dequantize(torch.empty(0, 8)).shape == (0, 8)
    assert DynamicFakeQuantize(dynamic_activation_spec())(torch.empty(0, 8)).shape == (0, 8)
    dyn = QPARAMS_CALCULATORS.get_class("dynamic").from_spec(
        QuantizationSpec(dtype="int8", granularity=PerChannel(1), qparams_calculator="dynamic"))
    scale, zero_point, _ = dyn(torch.empty(0, 8))  # qparams of [0, 0]: the smallest scale, zero point 0
    assert scale.shape == (8,) and bool((scale > 0).all()) and zero_point.tolist() == [0] * 8


def test_input_statistics_and_channel_absmax_ignore_empty_batches() -> None:
    stats = InputStatistics(hessian=True)
    stats.update(torch.empty(0, 4))
    assert not stats.has_statistics
    stats.update(X)
    before = _state(stats)
    stats.update(torch.empty(0, 4))
    stats.update(torch.empty(2, 0, 4))
    _assert_same_state(before, _state(stats))
    assert float(stats.count) == 2.0

    absmax = ChannelAbsMax()
    absmax.update("x", X)
    absmax.update("x", torch.empty(0, 4))
    assert absmax.values["x"].tolist() == [1.0, 3.0, 2.0, 1.0]
