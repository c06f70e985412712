from __future__ import annotations

import pytest

from coreai_opt.config import PresetInfo, QuantizerConfig, presets
from coreai_opt.quantization.spec import PerBlock, PerChannel, PerTensor, QuantizationScheme

SYM = QuantizationScheme.SYMMETRIC
ASYM = QuantizationScheme.ASYMMETRIC
PER_CHANNEL_INT8 = ("int8", QuantizationScheme.SYMMETRIC_WITH_CLIPPING, PerChannel(axis=0), "minmax", "static")
PER_BLOCK_INT4 = ("int4", QuantizationScheme(presets.W4_QSCHEME), PerBlock(axis=1, block_size=32), "minmax", "static")

# name -> (weight (dtype, qscheme, granularity, range, qparams) or None, activation ... or None, int32_bias)
EXPECTED = {
    "w8": (PER_CHANNEL_INT8, None, True),
    "w4": (PER_BLOCK_INT4, None, False),
    "w8a8": (PER_CHANNEL_INT8, ("uint8", ASYM, PerTensor(), "minmax", "global_minmax"), True),
    "w8a8_sym": (PER_CHANNEL_INT8, ("int8", SYM, PerTensor(), "minmax", "global_minmax"), True),
    "w4a8": (PER_BLOCK_INT4, ("uint8", ASYM, PerTensor(), "minmax", "global_minmax"), False),
    "w8a16": (PER_CHANNEL_INT8, ("uint16", ASYM, PerTensor(), "minmax", "global_minmax"), True),
    "fp8": (
        ("float8_e4m3fn", SYM, PerChannel(axis=0), "minmax", "static"),
        ("float8_e4m3fn", SYM, PerTensor(), "minmax", "global_minmax"),
        False,
    ),
}


def _fields(spec):
    if spec is None:
        return None
    return (spec.dtype, spec.qscheme, spec.granularity, spec.range_calculator, spec.qparams_calculator)


def test_presets_names_are_the_documented_set_in_order():
    assert QuantizerConfig.presets.names() == ("w8", "w4", "w8a8", "w8a8_sym", "w4a8", "w8a16", "fp8")
    assert set(QuantizerConfig.presets.names()) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_builds_documented_specs(name):
    cfg = getattr(QuantizerConfig.presets, name)()
    weight, activation, int32_bias = EXPECTED[name]
    assert isinstance(cfg, QuantizerConfig)
    assert _fields(cfg.weight) == weight
    assert _fields(cfg.activation) == activation
    assert cfg.int32_bias is int32_bias
    assert (cfg.op_kind, cfg.module_type, cfg.module_name) == ({}, {}, {})
    assert cfg.fold_batchnorm is True and cfg.fixed_range_outputs is True


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_round_trips_through_dict_and_yaml(name):
    cfg = QuantizerConfig.from_preset(name)
    assert QuantizerConfig.from_dict(cfg.to_dict()) == cfg
    assert QuantizerConfig.from_yaml(cfg.to_yaml()) == cfg


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_resolves_its_global_specs_for_a_conv(name):
    cfg = QuantizerConfig.from_preset(name)
    resolved = cfg.resolve("conv", "conv1", None)
    assert (resolved.weight, resolved.activation, resolved.source) == (cfg.weight, cfg.activation, "global")


def test_preset_quant_ranges_match_dtype_table():
    w8a8 = QuantizerConfig.presets.w8a8()
    assert (w8a8.weight.quant_min, w8a8.weight.quant_max) == (-127, 127)  # the narrowed int8 weight grid
    assert (w8a8.activation.quant_min, w8a8.activation.quant_max) == (0, 255)
    w8a16 = QuantizerConfig.presets.w8a16()
    assert (w8a16.activation.quant_min, w8a16.activation.quant_max) == (0, 65535)
    w4 = QuantizerConfig.presets.w4()
    assert (w4.weight.quant_min, w4.weight.quant_max) == (-8, 7)
    assert QuantizerConfig.presets.fp8().activation.quant_max == 448.0


def test_preset_calls_return_independent_configs():
    a = QuantizerConfig.presets.w8a8()
    b = QuantizerConfig.presets.w8a8()
    a.set_op_kind("softmax", None)
    assert a is not b
    assert b.op_kind == {}


def test_w4_block_size_sets_per_block_granularity():
    assert QuantizerConfig.presets.w4(block_size=64).weight.granularity == PerBlock(axis=1, block_size=64)
    assert QuantizerConfig.presets.w4a8(block_size=16).weight.granularity == PerBlock(axis=1, block_size=16)


@pytest.mark.parametrize("block_size", [0, -32, 2.5, True])
def test_w4_rejects_invalid_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        QuantizerConfig.presets.w4(block_size=block_size)


@pytest.mark.parametrize(
    ("activation_range", "range_calculator", "qparams_calculator"),
    [
        ("minmax", "minmax", "global_minmax"),
        ("moving_average", "minmax", "moving_average"),
        ("percentile", "percentile", "static"),
        ("mse", "mse", "static"),
        ("entropy", "entropy", "static"),
    ],
)
def test_w8a8_activation_range_selects_calculators(activation_range, range_calculator, qparams_calculator):
    act = QuantizerConfig.presets.w8a8(activation_range=activation_range).activation
    assert (act.range_calculator, act.qparams_calculator) == (range_calculator, qparams_calculator)
    assert (act.dtype, act.qscheme, act.granularity) == ("uint8", ASYM, PerTensor())


def test_activation_range_applies_to_every_activation_preset():
    for factory in (presets.w8a8_sym, presets.w4a8, presets.w8a16, presets.fp8):
        act = factory(activation_range="moving_average").activation
        assert (act.range_calculator, act.qparams_calculator) == ("minmax", "moving_average")


def test_w8a8_rejects_unknown_activation_range_listing_choices():
    with pytest.raises(ValueError, match=r"'histogram'.*minmax, moving_average, percentile, mse, entropy"):
        QuantizerConfig.presets.w8a8(activation_range="histogram")


def test_w8a8_percentile_sets_spec_percentile():
    act = QuantizerConfig.presets.w8a8(activation_range="percentile", percentile=99.9).activation
    assert act.percentile == 99.9


def test_w8a8_percentile_rejected_with_other_range():
    with pytest.raises(ValueError, match=r"percentile=99\.9 only applies"):
        QuantizerConfig.presets.w8a8(activation_range="mse", percentile=99.9)


def test_presets_get_returns_factory():
    assert QuantizerConfig.presets.get("w8a8") is presets.w8a8
    assert QuantizerConfig.presets.get("w4")(block_size=16).weight.granularity.block_size == 16


def test_presets_get_unknown_name_lists_valid_names():
    with pytest.raises(
        ValueError,
        match=r"unknown preset 'int8'; valid presets: w8, w4, w8a8, w8a8_sym, w4a8, w8a16, fp8, w8a8_dynamic",
    ):
        QuantizerConfig.presets.get("int8")


def test_from_preset_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"'W8A8'.*w8a8_sym"):
        QuantizerConfig.from_preset("W8A8")


def test_all_names_add_w8a8_dynamic_and_get_builds_it():
    assert QuantizerConfig.presets.all_names() == (*QuantizerConfig.presets.names(), "w8a8_dynamic")
    assert QuantizerConfig.from_preset("w8a8_dynamic") == QuantizerConfig.presets.w8a8_dynamic()


def test_from_preset_equals_calling_the_factory():
    assert QuantizerConfig.from_preset("w8a16") == QuantizerConfig.presets.w8a16()


def test_describe_lists_every_preset_with_summaries():
    rows = QuantizerConfig.presets.describe()
    assert [r.name for r in rows] == list(QuantizerConfig.presets.names())
    assert all(isinstance(r, PresetInfo) for r in rows)
    by_name = {r.name: r for r in rows}
    assert by_name["w8a8"] == PresetInfo(
        "w8a8",
        "int8 symmetric_with_clipping per-channel(axis=0), minmax/static",
        "uint8 asymmetric per-tensor, minmax/global_minmax",
    )
    assert by_name["w4"].weight == (
        f"int4 {presets.W4_QSCHEME} per-block(axis=1, block_size=32), minmax/static, gptq rounding"
    )
    assert by_name["w4"].activation == "float"
    assert by_name["fp8"].activation == "float8_e4m3fn symmetric per-tensor, minmax/global_minmax"


def test_w4_presets_round_with_gptq_by_default_and_take_algorithm_and_qscheme():
    for factory in (QuantizerConfig.presets.w4, QuantizerConfig.presets.w4a8):
        assert factory().weight.weight_rounding == "gptq"
        assert factory(algorithm="hqq", qscheme="asymmetric").weight.weight_rounding == "hqq"
        assert factory(qscheme="asymmetric").weight.qscheme is ASYM
        assert factory(algorithm=None).weight.weight_rounding is None
        with pytest.raises(ValueError, match="qscheme must be 'symmetric' or 'asymmetric'"):
            factory(qscheme="symmetric_with_clipping")
        with pytest.raises(ValueError, match="unknown weight rounding|not registered|valid"):
            factory(algorithm="awq")


def test_preset_int8_weights_put_each_rows_largest_weight_exactly_on_a_level():
    """The narrowed grid (scale = max|W_r| / 127) rounds the extreme weight with no error; the full grid (/ 127.5)
    by half a step, which dominates a short row's error."""
    import torch

    from coreai_opt.quantization.spec import compute_qparams

    spec = QuantizerConfig.presets.w8a8().weight
    w = torch.tensor([[0.9, -0.31, 0.05, 0.4], [-1.2, 0.7, 0.33, -0.01]])
    amax = w.abs().amax(dim=1)
    qp = compute_qparams(-amax, amax, spec.dtype_info, spec.qscheme)
    assert torch.equal(qp.scale, amax / 127)
    s = qp.scale.unsqueeze(1)
    w_hat = torch.clamp(torch.round(w / s), spec.quant_min, spec.quant_max) * s
    assert torch.equal(w_hat[:, 0], w[:, 0])  # the extreme of each row is exact
    full = compute_qparams(-amax, amax, spec.dtype_info, "symmetric")
    assert torch.allclose(full.scale, amax / 127.5)
