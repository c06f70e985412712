"""Bad calibration data: NaN/Inf, degenerate tensors (all-zero, constant, one element, batch size 1) and batches
that do not match the example inputs.

Degenerate data must give finite, strictly positive scales (the documented ``eps`` floor for a zero range) and a
fake-quantized output within half a step of the input; non-finite values are ignored with a warning naming the
quantizer; data that cannot be used raises an error naming the input and the fix.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.errors import InputValidationError
from coreai_opt.quantization.spec import FakeQuantize, QuantizationSpec
from coreai_opt.quantization.spec.qparams_math import SCALE_EPS

from .conftest import Pipeline

CALCULATORS = [("minmax", "static"), ("minmax", "moving_average"), ("minmax", "global_minmax"),
               ("percentile", "static"), ("mse", "static"), ("entropy", "static")]
DTYPES = [("int8", "symmetric"), ("uint8", "asymmetric"), ("int4", "symmetric_with_clipping"),
          ("float8_e4m3fn", "symmetric")]
DEGENERATE = {
    "all_zero": torch.zeros(4, 8),
    "constant_positive": torch.full((4, 8), 3.0),
    "constant_negative": torch.full((4, 8), -0.7),
    "one_element": torch.tensor([2.5]),
    "zero_dim": torch.tensor(-1.25),
    "batch_of_one": torch.linspace(-1.0, 2.0, 8).reshape(1, 8),
}


def _calibrated(spec: QuantizationSpec, *batches: torch.Tensor) -> FakeQuantize:
    fq = FakeQuantize(spec)
    fq.set_name("conv1.output")
    fq.enable_fake_quant(False)
    for batch in batches:
        fq(batch)
    fq.commit()
    fq.enable_observer(False)
    fq.enable_fake_quant(True)
    return fq


@pytest.mark.parametrize(("range_calculator", "qparams_calculator"), CALCULATORS)
@pytest.mark.parametrize(("dtype", "qscheme"), DTYPES)
@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_calibration_tensor_gives_finite_scale_and_half_step_error(
    range_calculator: str, qparams_calculator: str, dtype: str, qscheme: str, case: str
) -> None:
    """Invariant: scale finite and >= eps; |x - fq(x)| <= s/2 (+ float8 relative rounding) for the calibrated x."""
    x = DEGENERATE[case]
    spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, range_calculator=range_calculator,
                            qparams_calculator=qparams_calculator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # degenerate but finite data must not warn
        fq = _calibrated(spec, x)
        y = fq(x)
    scale = fq.calculator.scale
    assert bool(torch.isfinite(scale).all()) and float(scale.min()) >= SCALE_EPS
    if case == "all_zero":
        assert float(scale) == SCALE_EPS  # the documented floor, not a silent scale=1
        assert torch.equal(y, x)
    s = float(scale)
    if fq.calculator.zero_point is None:
        lo, hi = -448.0 * s, 448.0 * s
    else:
        zp = int(fq.calculator.zero_point)
        lo, hi = (spec.quant_min - zp) * s, (spec.quant_max - zp) * s
    inside = (x >= lo - s / 2 - 1e-7) & (x <= hi + s / 2 + 1e-7)  # full-range symmetric puts max_abs at 127.5 steps
    if range_calculator == "minmax":
        assert bool(inside.all()), "a min/max range never clips the data it was calibrated on"
    bound = s / 2 + (x.abs() * 2.0**-4 if dtype.startswith("float8") else 0.0)
    assert bool(((y - x).abs() <= bound + 1e-7)[inside].all()), f"max error {float((y - x).abs().max())} > s/2={s / 2}"
    clamped = torch.where(x < lo, torch.tensor(lo), torch.tensor(hi))
    assert torch.allclose(y[~inside], clamped[~inside], atol=s / 2 + 1e-7), "values outside the range saturate"


@pytest.mark.parametrize(("range_calculator", "qparams_calculator"), CALCULATORS)
def test_nan_and_inf_are_ignored_with_one_warning_naming_the_quantizer(range_calculator: str,
                                                                      qparams_calculator: str) -> None:
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", range_calculator=range_calculator,
                            qparams_calculator=qparams_calculator)
    finite = torch.tensor([1.0, -2.0, 0.5, 3.0])
    dirty = torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.5, float("-inf"), 3.0])
    with pytest.warns(RuntimeWarning, match=r"conv1\.output\.\w+RangeCalculator: the observed tensor contains NaN or "
                                            r"Inf; those values are ignored") as record:
        dirty_fq = _calibrated(spec, dirty, dirty)
    assert len([w for w in record if "NaN or Inf" in str(w.message)]) == 1, "one warning per quantizer, not per batch"
    clean_fq = _calibrated(spec, finite, finite)
    assert torch.equal(dirty_fq.calculator.scale, clean_fq.calculator.scale)
    assert torch.equal(dirty_fq.calculator.zero_point, clean_fq.calculator.zero_point)


@pytest.mark.parametrize(("range_calculator", "qparams_calculator"), [("minmax", "static"), ("percentile", "static"),
                                                                      ("mse", "static"), ("entropy", "static")])
def test_all_nan_calibration_leaves_the_quantizer_uncalibrated_and_says_so(range_calculator: str,
                                                                          qparams_calculator: str) -> None:
    spec = QuantizationSpec(dtype="int8", range_calculator=range_calculator, qparams_calculator=qparams_calculator)
    with pytest.warns(RuntimeWarning, match=r"conv1\.output"):
        fq = _calibrated(spec, torch.full((2, 3), float("nan")))
    assert not fq.calculator.has_qparams
    with pytest.raises(RuntimeError, match=r"conv1\.output: fake quantization is on but no qparams were computed") as e:
        fq(torch.ones(2, 3))
    assert "run coreai_opt.calibrate(...) first" in str(e.value)


def test_per_channel_row_without_finite_values_gets_a_finite_scale() -> None:
    spec = QuantizationSpec(dtype="int8", granularity={"type": "per_channel", "axis": 0},
                            qparams_calculator="global_minmax")
    x = torch.tensor([[1.0, -4.0], [float("nan"), float("inf")], [0.0, 0.0]])
    with pytest.warns(RuntimeWarning, match=r"conv1\.output"):
        fq = _calibrated(spec, x)
    scale = fq.calculator.scale
    assert bool(torch.isfinite(scale).all())
    assert scale.tolist() == pytest.approx([4.0 / 127.5, SCALE_EPS, SCALE_EPS])


# ------------------------------------------------------------------------------------------------ through the API
@pytest.fixture
def prepared(cnn_pipeline: Pipeline) -> torch.fx.GraphModule:
    return copy.deepcopy(cnn_pipeline.prepared)


def _input_scale(model: torch.fx.GraphModule) -> torch.Tensor:
    return model.get_submodule("x_input_fq").calculator.scale.clone()


def test_calibrate_warns_naming_the_input_quantizer_and_ignores_nan(prepared: torch.fx.GraphModule,
                                                                   cnn_pipeline: Pipeline) -> None:
    batch = cnn_pipeline.data[0].clone()
    clean = copy.deepcopy(prepared)
    co.calibrate(clean, [batch], progress=False)
    batch[0, 0, 0, 0] = float("nan")
    batch[1, 2, 3, 4] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"x\.input\.MinMaxRangeCalculator: the observed tensor contains NaN"):
        co.calibrate(prepared, [batch], progress=False)
    finite = cnn_pipeline.data[0].flatten()
    finite = finite[torch.isfinite(batch.flatten())]
    expected = (finite.max() - finite.min()) / 255.0
    assert math.isclose(float(_input_scale(prepared)), float(expected), rel_tol=1e-6)
    assert float(_input_scale(prepared)) <= float(_input_scale(clean))


@pytest.mark.parametrize("batch_shape", [(1, 3, 8, 8), (7, 3, 8, 8)])
def test_calibrate_accepts_any_batch_size(prepared: torch.fx.GraphModule, batch_shape: tuple[int, ...]) -> None:
    co.calibrate(prepared, [torch.randn(batch_shape)], progress=False)
    converted = co.convert(prepared)
    for _, fq in fake_quantizers(converted):
        scale = getattr(fq.calculator, "scale", None)
        if scale is not None:
            assert bool(torch.isfinite(scale).all()) and float(scale.min()) > 0, fq.name


def test_calibrate_with_all_zero_and_constant_batches_gives_finite_qparams(prepared: torch.fx.GraphModule,
                                                                          cnn_pipeline: Pipeline) -> None:
    co.calibrate(prepared, [torch.zeros(2, 3, 8, 8), torch.full((2, 3, 8, 8), 0.25)], progress=False)
    converted = co.convert(prepared)
    scales = {fq.name: fq.calculator.scale for _, fq in fake_quantizers(converted)
              if hasattr(fq.calculator, "scale")}
    assert all(bool(torch.isfinite(s).all()) and float(s.min()) > 0 for s in scales.values()), scales
    assert math.isclose(float(scales["x.input"]), 0.25 / 255.0, rel_tol=1e-6)
    out = converted(cnn_pipeline.example)
    assert bool(torch.isfinite(out).all())


BAD_DATA = [
    ("empty list", [], ValueError, r"calibration data is empty", r"pass an iterable with at least one batch"),
    ("empty generator", (b for b in ()), ValueError, r"calibration data is empty", r"at least one batch"),
    ("wrong dtype", [torch.randn(2, 3, 8, 8, dtype=torch.float64)], InputValidationError,
     r"^calibration batch 0: input 'x' is float64 of shape \(2, 3, 8, 8\)", r"but the example input given to "
     r"prepare was float32 of shape \(4, 3, 8, 8\); pass inputs of that dtype and rank \(only the batch dimension "
     r"is free\)"),
    ("wrong rank", [torch.randn(2, 3, 8)], InputValidationError,
     r"^calibration batch 0: input 'x' is float32 of shape \(2, 3, 8\)", r"pass inputs of that dtype and rank"),
    ("wrong spatial shape", [torch.randn(2, 3, 9, 9)], InputValidationError,
     r"calibration batch 0 failed: input 'x' has shape \(2, 3, 9, 9\)", r"the example input had \(4, 3, 8, 8\)"),
    ("int tensor", [torch.ones(2, 3, 8, 8, dtype=torch.int64)], InputValidationError, r"'x' is int64",
     r"example input given to prepare was float32"),
    ("batch of wrong type", ["not a tensor"], TypeError, r"got str",
     r"must be a tensor, a tuple/list of positional inputs or a dict of keyword inputs"),
    ("max_batches=0", None, ValueError, r"max_batches must be a positive int or None, got 0", r"positive int"),
    ("bad sync", None, ValueError, r"sync='bogus' is not one of", r"use sync='auto'"),
]


@pytest.mark.parametrize(("label", "data", "error", "names", "fix"), BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_calibrate_rejects_unusable_data_naming_the_input_and_fix(prepared: torch.fx.GraphModule, label: str, data,
                                                                 error: type[Exception], names: str, fix: str) -> None:  # noqa: ANN001
    kwargs: dict = {}
    if label == "max_batches=0":
        data, kwargs = [torch.randn(2, 3, 8, 8)], {"max_batches": 0}
    if label == "bad sync":
        data, kwargs = [torch.randn(2, 3, 8, 8)], {"sync": "bogus"}
    flags_before = [(bool(fq.observer_enabled), bool(fq.fake_quant_enabled))
                    for _, fq in fake_quantizers(prepared)]
    with pytest.raises(error, match=names) as info:
        co.calibrate(prepared, data, progress=False, **kwargs)
    assert re.search(fix, str(info.value)), str(info.value)
    flags_after = [(bool(fq.observer_enabled), bool(fq.fake_quant_enabled))
                   for _, fq in fake_quantizers(prepared)]
    assert flags_after == flags_before, "a failed calibration must restore the quantizer flags"


def test_calibrate_rejects_a_model_that_was_not_prepared() -> None:
    with pytest.raises(TypeError, match=r"calibrate expects a model returned by coreai_opt\.prepare\(\.\.\.\), got "
                                        r"Sequential") as info:
        co.calibrate(nn.Sequential(nn.Linear(2, 2)), [torch.randn(1, 2)], progress=False)
    assert "call prepared = coreai_opt.prepare(model, config, example_inputs) first" in str(info.value)


def test_calibrate_rejects_a_converted_model(cnn_pipeline: Pipeline) -> None:
    with pytest.raises(ValueError, match=r"calibrate needs a prepared model, got a converted one") as info:
        co.calibrate(copy.deepcopy(cnn_pipeline.converted), cnn_pipeline.data, progress=False)
    assert "calibrate before convert" in str(info.value)


def test_convert_names_every_activation_quantizer_that_was_never_calibrated() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"2 activation quantizer\(s\) were never calibrated: "
                                         r"(?=.*\binput\.input\b)(?=.*\b1\.output\b)") as info:
        co.convert(prepared)
    assert "run coreai_opt.calibrate(prepared, data)" in str(info.value)
