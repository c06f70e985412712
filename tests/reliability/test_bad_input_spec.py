"""Bad spec input: every invalid QuantizationSpec / granularity is refused at construction (or, for a spec that
only fails against a tensor, at ``prepare`` time with the node or module named), with a message naming the
offending field or value and the fix."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.config import OpConfig
from coreai_opt.quantization.spec import PerBlock, PerChannel, QuantizationSpec

VALID_DTYPES = "int8, uint8, int16, uint16, int4, uint4, float8_e4m3fn, float8_e5m2"

# (spec kwargs, exception type, regex naming the offending thing, regex naming the fix)
SPEC_CASES: list[tuple[dict, type[Exception], str, str]] = [
    # dtype
    ({"dtype": "int7"}, ValueError, r"unsupported quantized dtype 'int7'",
     re.escape(f"valid dtypes are: {VALID_DTYPES}")),
    ({"dtype": torch.float32}, ValueError, r"unsupported quantized dtype torch\.float32", r"valid dtypes are: int8"),
    ({"dtype": "int32"}, ValueError, r"unsupported quantized dtype 'int32'", r"valid dtypes are: int8"),
    ({"dtype": 8}, TypeError, r"dtype must be a string .* got 8", r"such as 'int8' or a torch dtype"),
    # scheme
    ({"dtype": "int8", "qscheme": "sym"}, ValueError, r"qscheme",
     r"'symmetric', 'symmetric_with_clipping' or 'asymmetric'"),
    ({"dtype": "float8_e4m3fn", "qscheme": "asymmetric"}, ValueError, r"qscheme='asymmetric' is invalid for dtype "
     r"'float8_e4m3fn'", r"use qscheme='symmetric'"),
    ({"dtype": "float8_e5m2", "qscheme": "asymmetric"}, ValueError, r"'float8_e5m2'", r"use qscheme='symmetric'"),
    # granularity / axis / block size
    ({"dtype": "int8", "granularity": {"type": "per_row"}}, ValueError, r"unknown granularity type 'per_row'",
     r"valid types are: per_axes, per_block, per_channel, per_tensor"),
    ({"dtype": "int8", "granularity": "per_tensor"}, ValueError, r"got 'per_tensor'",
     r"must be a dict with a 'type' key"),
    ({"dtype": "int8", "granularity": {"axis": 0}}, ValueError, r"got \{'axis': 0\}",
     r"must be a dict with a 'type' key"),
    ({"dtype": "int8", "granularity": {"type": "per_channel", "axis": 0, "block_size": 2}}, ValueError,
     r"'per_channel' got unknown key\(s\) \['block_size'\]", r"allowed keys: \['axis'\]"),
    ({"dtype": "int8", "granularity": {"type": "per_channel", "axis": 1.5}}, TypeError, r"got 1\.5",
     r"PerChannel axis must be an int"),
    ({"dtype": "int8", "granularity": {"type": "per_channel", "axis": True}}, TypeError, r"got True",
     r"PerChannel axis must be an int"),
    ({"dtype": "int4", "granularity": {"type": "per_block", "axis": 1, "block_size": 0}}, ValueError, r"got 0\b",
     r"block_size must be a positive int"),
    ({"dtype": "int4", "granularity": {"type": "per_block", "axis": 1, "block_size": -32}}, ValueError, r"got -32",
     r"block_size must be a positive int"),
    ({"dtype": "int4", "granularity": {"type": "per_block", "axis": 1, "block_size": 2.0}}, ValueError, r"got 2\.0",
     r"block_size must be a positive int"),
    ({"dtype": "int4", "granularity": {"type": "per_block", "axis": "1", "block_size": 2}}, TypeError, r"got '1'",
     r"PerBlock axis must be an int"),
    # float_range
    ({"dtype": "int8", "float_range": (0.5, 2.0)}, ValueError, r"float_range min 0\.5", r"must be <= 0"),
    ({"dtype": "int8", "float_range": (1.0, 1.0)}, ValueError, r"float_range min 1\.0", r"must be <= 0"),
    ({"dtype": "int8", "float_range": (-2.0, -0.5)}, ValueError, r"float_range max -0\.5", r"must be >= 0"),
    ({"dtype": "int8", "float_range": (0.0, 0.0)}, ValueError, r"float_range=\(0\.0, 0\.0\)", r"needs min < max"),
    ({"dtype": "int8", "float_range": (float("nan"), 1.0)}, ValueError, r"float_range=\(nan, 1\.0\)",
     r"must contain finite numbers or None"),
    ({"dtype": "int8", "float_range": (-1.0, float("inf"))}, ValueError, r"float_range=\(-1\.0, inf\)",
     r"must contain finite numbers or None"),
    # registry keys and combinations
    ({"dtype": "int8", "range_calculator": "maxmin"}, ValueError, r"unknown range calculator 'maxmin'",
     r"registered range calculators are: 'entropy', 'minmax', 'mse', 'percentile'"),
    ({"dtype": "int8", "qparams_calculator": "ema"}, ValueError, r"unknown qparams calculator 'ema'",
     r"registered qparams calculators are: 'dynamic', 'global_minmax', 'moving_average', 'static'"),
    ({"dtype": "int8", "fake_quantize": "fancy"}, ValueError, r"unknown fake quantize 'fancy'",
     r"registered .* 'default'"),
    ({"dtype": "int8", "range_calculator": 3}, TypeError, r"range_calculator must be .* got 3",
     r"registry key \(str\)"),
    ({"dtype": "int8", "range_calculator": "percentile", "qparams_calculator": "moving_average"}, ValueError,
     r"range_calculator='percentile'.*got qparams_calculator='moving_average'", r"needs qparams_calculator='static'"),
    ({"dtype": "int8", "qparams_calculator": "dynamic", "float_range": (-1.0, 1.0)}, ValueError,
     r"qparams_calculator='dynamic' is stateless and cannot use float_range", r"drop float_range or use"),
    # numeric knobs and unknown fields
    ({"dtype": "int8", "averaging_constant": 0.0}, ValueError, r"averaging_constant=0\.0",
     r"0 < averaging_constant <= 1"),
    ({"dtype": "int8", "percentile": 50.0}, ValueError, r"percentile=50\.0", r"50 < percentile <= 100"),
    ({"dtype": "int8", "num_bins": 1000}, ValueError, r"num_bins=1000", r"use e\.g\. num_bins=512 or 1024"),
    ({"dtype": "int8", "dtyp": "int8"}, ValueError, r"dtyp\b", r"valid fields are: dtype, qscheme"),
]


@pytest.mark.parametrize(("kwargs", "error", "names", "fix"), SPEC_CASES, ids=[str(i) for i in range(len(SPEC_CASES))])
def test_spec_rejects_bad_field_naming_it_and_the_fix(kwargs: dict, error: type[Exception], names: str,
                                                      fix: str) -> None:
    with pytest.raises(error, match=names) as info:
        QuantizationSpec(**kwargs)
    assert re.search(fix, str(info.value)), f"message does not say how to fix it: {info.value}"


@pytest.mark.parametrize(
    ("make", "shape", "names", "fix"),
    [
        (lambda: PerChannel(axis=2), (4, 4), r"per-channel axis=2 is out of range for a tensor of rank 2",
         r"use an axis in \[-2, 1\]"),
        (lambda: PerChannel(axis=-3), (4, 4), r"axis=-3", r"use an axis in \[-2, 1\]"),
        (lambda: PerBlock(axis=0, block_size=3), (4, 4), r"block_size=3 does not divide dimension 0 of size 4",
         r"pick a block size that divides 4"),
        (lambda: PerBlock(axis=4, block_size=2), (4, 4), r"per-block axis=4 is out of range", r"use an axis in"),
    ],
)
def test_granularity_qparam_shape_rejects_tensor_it_does_not_fit(make, shape, names: str, fix: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=names) as info:
        make().qparam_shape(shape)
    assert re.search(fix, str(info.value))


def test_quantizer_config_names_the_config_field_of_a_bad_spec_dict() -> None:
    with pytest.raises(ValueError, match=r"QuantizerConfig\.weight: .*unsupported quantized dtype 'int9'") as info:
        co.QuantizerConfig(weight={"dtype": "int9"})
    assert "valid dtypes are: int8" in str(info.value)


# ---------------------------------------------------------------------------------------- detected at prepare time
def _prepare_linear(spec_kwargs: dict, role: str) -> None:
    spec = QuantizationSpec(**spec_kwargs)
    entry = OpConfig(weight=spec) if role == "weight" else OpConfig(activation=spec)
    config = co.QuantizerConfig.presets.w8a8().set_op_kind("linear", entry)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    co.prepare(model, config, (torch.randn(2, 4),))


def test_prepare_names_the_module_when_a_weight_axis_exceeds_its_rank() -> None:
    with pytest.raises(ValueError, match=r"0 \(linear\) weight \(6, 4\): per-channel axis=3 is out of range") as info:
        _prepare_linear({"dtype": "int8", "granularity": {"type": "per_channel", "axis": 3}}, "weight")
    assert re.search(r"use an axis in \[-2, 1\]", str(info.value))
    assert "2 (linear_1) weight (4, 6)" in str(info.value), "every offending module is listed, not just the first"


def test_prepare_names_the_node_when_an_activation_axis_exceeds_its_rank() -> None:
    names = r"quantizer for 1\.output \(%_1 : .*call_module\[target=1\].*\): per-channel axis=5 is out of range"
    with pytest.raises(ValueError, match=names) as info:
        _prepare_linear({"dtype": "int8", "granularity": {"type": "per_channel", "axis": 5}}, "activation")
    assert re.search(r"use an axis in \[-2, 1\]", str(info.value))


def test_prepare_names_the_module_when_a_block_size_does_not_divide_the_weight() -> None:
    spec = {"dtype": "int4", "granularity": {"type": "per_block", "axis": 1, "block_size": 3}}
    names = r"0 \(linear\) weight \(6, 4\): per-block block_size=3 does not divide"
    with pytest.raises(ValueError, match=names) as info:
        _prepare_linear(spec, "weight")
    assert re.search(r"pick a block size that divides", str(info.value))
    assert re.search(r"config\.set_module_name\(", str(info.value))


def test_a_spec_at_the_edge_of_validity_is_accepted() -> None:
    """The boundaries the validators draw are inclusive where documented (no off-by-one rejections)."""
    spec = QuantizationSpec(dtype="int8", float_range=(0.0, 1.0), averaging_constant=1.0, percentile=100.0, num_bins=16)
    assert spec.float_range == (0.0, 1.0)
    assert QuantizationSpec(dtype="int8", float_range=(-1.0, None)).float_range == (-1.0, None)
    assert QuantizationSpec(dtype="int8", float_range=(None, None)).float_range is None
    assert PerChannel(axis=-2).qparam_shape((4, 6)) == (4,)
    assert PerBlock(axis=1, block_size=6).qparam_shape((4, 6)) == (4, 1)
    assert math.isclose(QuantizationSpec(dtype=torch.int8).quant_max, 127)
