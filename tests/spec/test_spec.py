from __future__ import annotations

import json
from collections.abc import Callable

import pydantic
import pytest
import torch

from coreai_opt.quantization.spec import (
    RANGE_CALCULATORS,
    MinMaxRangeCalculator,
    PerBlock,
    PerChannel,
    PerTensor,
    QuantizationScheme,
    QuantizationSpec,
    Registry,
)


def test_spec_defaults_match_the_contract() -> None:
    spec = QuantizationSpec(dtype="int8")
    assert spec.qscheme is QuantizationScheme.SYMMETRIC
    assert spec.granularity == PerTensor()
    assert (spec.range_calculator, spec.qparams_calculator, spec.fake_quantize) == ("minmax", "static", "default")
    assert (spec.float_range, spec.averaging_constant, spec.percentile, spec.num_bins) == (None, 0.01, 99.99, 2048)


def test_spec_normalises_torch_dtype_and_granularity_dict() -> None:
    spec = QuantizationSpec(dtype=torch.uint8, granularity={"type": "per_block", "axis": 1, "block_size": 32})
    assert spec.dtype == "uint8"
    assert spec.granularity == PerBlock(axis=1, block_size=32)
    assert spec.dtype_info.quant_max == 255


@pytest.mark.parametrize(
    ("dtype", "qscheme", "expected"),
    [
        ("int8", "symmetric", (-128, 127)),
        ("int8", "symmetric_with_clipping", (-127, 127)),
        ("int4", "symmetric_with_clipping", (-7, 7)),
        ("int16", "symmetric_with_clipping", (-32767, 32767)),
        ("uint8", "symmetric_with_clipping", (0, 255)),
        ("uint4", "asymmetric", (0, 15)),
        ("float8_e4m3fn", "symmetric_with_clipping", (-448.0, 448.0)),
    ],
)
def test_spec_quant_range_is_narrowed_only_for_signed_clipping(dtype: str, qscheme: str, expected: tuple) -> None:
    spec = QuantizationSpec(dtype=dtype, qscheme=qscheme)
    assert (spec.quant_min, spec.quant_max) == expected


def test_spec_to_dict_from_dict_round_trip_through_json() -> None:
    spec = QuantizationSpec(
        dtype=torch.int8,
        qscheme="asymmetric",
        granularity=PerChannel(-1),
        qparams_calculator="moving_average",
        float_range=(-2.5, None),
        averaging_constant=0.1,
        percentile=99.9,
        num_bins=512,
    )
    data = spec.to_dict()
    assert data == {
        "dtype": "int8",
        "qscheme": "asymmetric",
        "granularity": {"type": "per_channel", "axis": -1},
        "range_calculator": "minmax",
        "qparams_calculator": "moving_average",
        "float_range": [-2.5, None],
        "averaging_constant": 0.1,
        "percentile": 99.9,
        "num_bins": 512,
        "fake_quantize": "default",
        "weight_rounding": None,
    }
    restored = QuantizationSpec.from_dict(json.loads(json.dumps(data)))
    assert restored == spec
    assert hash(restored) == hash(spec)


def test_spec_is_frozen() -> None:
    spec = QuantizationSpec(dtype="int8")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.dtype = "uint8"  # type: ignore[misc]


def test_spec_rejects_unknown_key_naming_it() -> None:
    message = r"unknown QuantizationSpec field\(s\) \[.averaging_const.\]; valid fields are: dtype, .*averaging_"
    with pytest.raises(ValueError, match=message):
        QuantizationSpec(dtype="int8", averaging_const=0.1)
    with pytest.raises(ValueError, match=r"unknown QuantizationSpec field\(s\) \[.ema_decay.\]; valid fields are"):
        QuantizationSpec.from_dict({"dtype": "int8", "ema_decay": 0.9})


def test_spec_wrong_dtype_string_lists_valid_dtypes() -> None:
    with pytest.raises(ValueError, match=r"(?s)dtype\n.*unsupported quantized dtype 'int3'.*int8, uint8, int16"):
        QuantizationSpec(dtype="int3")
    with pytest.raises(ValueError, match=r"'int32'"):
        QuantizationSpec(dtype="int32")


def test_spec_rejects_asymmetric_float8_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"qscheme='asymmetric' is invalid for dtype 'float8_e5m2'.*'symmetric'"):
        QuantizationSpec(dtype="float8_e5m2", qscheme="asymmetric")


@pytest.mark.parametrize(
    ("float_range", "message"),
    [
        ((0.5, 2.0), "float_range min 0.5 must be <= 0"),
        ((-2.0, -0.5), "float_range max -0.5 must be >= 0"),
        ((0.0, 0.0), r"needs min < max"),
        ((float("nan"), 1.0), "finite numbers"),
        ((None, float("inf")), "finite numbers"),
    ],
)
def test_spec_float_range_validation(float_range: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=rf"(?s)float_range\n.*{message}"):
        QuantizationSpec(dtype="int8", float_range=float_range)


def test_spec_float_range_none_pair_normalises_to_none() -> None:
    assert QuantizationSpec(dtype="int8", float_range=(None, None)).float_range is None
    assert QuantizationSpec(dtype="int8", float_range=(None, 3.0)).float_range == (None, 3.0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("averaging_constant", 0.0, "0 < averaging_constant <= 1"),
        ("averaging_constant", 1.5, "0 < averaging_constant <= 1"),
        ("percentile", 50.0, "50 < percentile <= 100"),
        ("percentile", 100.5, "50 < percentile <= 100"),
        ("num_bins", 8, "num_bins=8 must be a power of two >= 16"),
        ("num_bins", 2000, "num_bins=2000 must be a power of two >= 16"),
    ],
)
def test_spec_numeric_knob_bounds(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=rf"(?s){field}\n.*{message}"):
        QuantizationSpec(dtype="int8", **{field: value})


def test_spec_accepts_knob_bounds_inclusive_ends() -> None:
    spec = QuantizationSpec(dtype="int8", averaging_constant=1.0, percentile=100.0, num_bins=16)
    assert (spec.averaging_constant, spec.percentile, spec.num_bins) == (1.0, 100.0, 16)


def test_spec_accumulating_range_calculator_requires_static(
    temporary_registration: Callable[[Registry, str], Callable[[type], type]],
) -> None:
    @temporary_registration(RANGE_CALCULATORS, "accumulating_test_range")
    class Accumulating(MinMaxRangeCalculator):
        accumulates = True

    QuantizationSpec(dtype="int8", range_calculator="accumulating_test_range")
    with pytest.raises(ValueError, match="needs qparams_calculator='static', got qparams_calculator='moving_average'"):
        QuantizationSpec(dtype="int8", range_calculator="accumulating_test_range", qparams_calculator="moving_average")


def test_spec_dynamic_requires_minmax_and_no_float_range(
    temporary_registration: Callable[[Registry, str], Callable[[type], type]],
) -> None:
    temporary_registration(RANGE_CALCULATORS, "other_test_range")(type("Other", (MinMaxRangeCalculator,), {}))
    with pytest.raises(ValueError, match="needs range_calculator='minmax', got range_calculator='other_test_range'"):
        QuantizationSpec(dtype="int8", qparams_calculator="dynamic", range_calculator="other_test_range")
    with pytest.raises(ValueError, match="stateless and cannot use float_range"):
        QuantizationSpec(dtype="int8", qparams_calculator="dynamic", float_range=(-1.0, 1.0))


def test_spec_accepts_registered_class_and_stores_its_key() -> None:
    spec = QuantizationSpec(dtype="int8", range_calculator=MinMaxRangeCalculator)
    assert spec.range_calculator == "minmax"
