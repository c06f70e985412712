from __future__ import annotations

import pytest
import torch

from coreai_opt.quantization.spec import (
    SUPPORTED_DTYPES,
    BiasFakeQuantize,
    FakeQuantize,
    PerBlock,
    PerChannel,
    QuantizationSpec,
    quantize_dequantize,
)

# int8 symmetric with max_abs = 127.5 / 16 gives the exact power-of-two scale 1/16.
POW2_SPEC = QuantizationSpec(dtype="int8", float_range=(-7.96875, 7.96875))
S = 0.0625


def _calibrated(spec: QuantizationSpec, *batches: torch.Tensor) -> FakeQuantize:
    fq = FakeQuantize(spec)
    fq.enable_fake_quant(False)
    for batch in batches:
        fq(batch)
    fq.commit()
    fq.enable_observer(False)
    fq.enable_fake_quant(True)
    return fq


def test_fake_quantize_rounds_half_to_even_and_clamps() -> None:
    fq = _calibrated(POW2_SPEC, torch.tensor([1.0]))
    x = torch.tensor([0.5, 1.5, 2.5, -3.5, -0.5, 200.0, -200.0, 127.0, -128.0]) * S
    y = fq(x)
    # q = [0, 2, 2, -4, -0, 127 (clamped), -128 (clamped), 127, -128]
    assert (y / S).tolist() == [0.0, 2.0, 2.0, -4.0, 0.0, 127.0, -128.0, 127.0, -128.0]


def test_fake_quantize_calibration_mode_returns_input_and_commits_lazily() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.enable_fake_quant(False)
    x = torch.tensor([-1.0, 2.55])
    assert fq(x) is x
    assert not fq.calculator.has_qparams  # observed only, nothing committed yet
    fq.enable_observer(False)
    fq.enable_fake_quant(True)
    fq(torch.tensor([0.0]))  # first evaluation forward commits the pending statistics
    assert fq.calculator.scale.item() == torch.tensor(2.55 / 127.5).item()


def test_fake_quantize_commit_turns_pending_statistics_into_qparams() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="uint8", qscheme="asymmetric", qparams_calculator="global_minmax"))
    fq.enable_fake_quant(False)
    fq(torch.tensor([-1.0, 1.0]))
    fq(torch.tensor([0.0, 3.0]))
    fq.commit()
    # Range [-1, 3]: scale 4/255, zp 64
    assert fq.calculator.scale.item() == torch.tensor(4 / 255).item() and fq.calculator.zero_point.item() == 64


def test_fake_quantize_qat_mode_uses_fresh_qparams_every_step() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    y1 = fq(torch.tensor([-1.0, 1.0]))
    y2 = fq(torch.tensor([-4.0, 2.0]))
    assert y1.tolist() == pytest.approx([-1.0, 1.0], abs=1 / 255)
    assert fq.calculator.scale.item() == torch.tensor(4 / 127.5).item()
    assert y2[0].item() == pytest.approx(-4.0, abs=2 / 127.5)


def test_fake_quantize_raises_naming_quantizer_when_never_calibrated() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.set_name("layer1.conv.output")
    fq.enable_observer(False)
    with pytest.raises(RuntimeError, match=r"layer1\.conv\.output.*run coreai_opt\.calibrate\(\.\.\.\) first"):
        fq(torch.ones(2))


def test_fake_quantize_is_identity_when_both_flags_off() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.enable_observer(False)
    fq.enable_fake_quant(False)
    x = torch.randn(3)
    assert fq(x) is x


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_fake_quantize_prepared_and_export_mode_outputs_are_bitwise_identical(dtype: str) -> None:
    spec = QuantizationSpec(dtype=dtype, granularity=PerChannel(1), qparams_calculator="moving_average")
    fq = _calibrated(spec, torch.randn(4, 6), torch.randn(4, 6) * 2)
    x = torch.randn(16, 6) * 3
    prepared = fq(x)
    fq.set_export_mode(True)
    assert not bool(fq.observer_enabled) and bool(fq.fake_quant_enabled) and fq.export_mode
    assert torch.equal(fq(x), prepared)


def test_set_export_mode_commits_pending_statistics() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8"))
    fq.enable_fake_quant(False)
    fq(torch.tensor([-2.0, 1.0]))
    fq.set_export_mode(True)
    assert fq.calculator.export_mode and fq.calculator.scale.item() == torch.tensor(2 / 127.5).item()


def test_fake_quantize_ste_gradient_is_one_inside_and_zero_where_clamped() -> None:
    fq = _calibrated(QuantizationSpec(dtype="uint8", qscheme="asymmetric", float_range=(-1.0, 3.0)), torch.ones(1))
    scale, zp = fq.calculator.scale.item(), fq.calculator.zero_point.item()  # 4/255, 64
    # round(x/s) + zp: below 0 or above 255 is clamped. -1.0 maps to exactly q = 0 (inside).
    x = torch.tensor([-1.0, -1.0 - scale, -5.0, 0.0, 2.9, 3.0 + scale, 10.0], requires_grad=True)
    fq(x).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert zp == 64


def test_fake_quantize_ste_gradient_for_float8_saturation() -> None:
    fq = _calibrated(QuantizationSpec(dtype="float8_e4m3fn", float_range=(-448.0, 448.0)), torch.ones(1))
    x = torch.tensor([-500.0, -448.0, 0.1, 448.0, 449.0], requires_grad=True)
    y = fq(x)
    y.backward(torch.full_like(y, 2.0))
    assert x.grad.tolist() == [0.0, 2.0, 2.0, 2.0, 0.0]
    assert y.tolist()[0] == -448.0 and y.tolist()[-1] == 448.0


def test_quantize_dequantize_gives_no_gradient_to_scale() -> None:
    scale = torch.tensor(0.5, requires_grad=True)
    x = torch.tensor([0.2, 0.9], requires_grad=True)
    quantize_dequantize(x, scale, torch.tensor(0, dtype=torch.int32), -128, 127, 0, 0, "int8").sum().backward()
    assert scale.grad is None and x.grad.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_quantize_low_precision_input_computes_in_float32(dtype: torch.dtype) -> None:
    fq = _calibrated(QuantizationSpec(dtype="int8"), torch.randn(8))
    x = torch.randn(32).to(dtype)
    y = fq(x)
    assert y.dtype == dtype and fq.calculator.scale.dtype == torch.float32
    assert torch.equal(y, fq(x.float()).to(dtype))


def test_fake_quantize_initialize_preallocates_buffers_for_strict_loading() -> None:
    spec = QuantizationSpec(dtype="int8", granularity=PerBlock(axis=1, block_size=4))
    fq = FakeQuantize(spec)
    fq.initialize((6, 8))
    assert fq.calculator.scale.shape == (6, 2) and not fq.calculator.has_qparams


def test_fake_quantize_state_dict_round_trip_into_never_run_module() -> None:
    spec = QuantizationSpec(dtype="int4", qscheme="asymmetric", granularity=PerChannel(0),
                            qparams_calculator="moving_average")
    trained = _calibrated(spec, torch.randn(5, 7), torch.randn(5, 7))
    state = trained.state_dict()
    fresh = FakeQuantize(spec)
    fresh.load_state_dict(state, strict=True)
    assert not bool(fresh.observer_enabled) and bool(fresh.fake_quant_enabled)
    x = torch.randn(5, 7) * 2
    assert torch.equal(fresh(x), trained(x))
    fresh.set_export_mode(True)
    assert torch.equal(fresh(x), trained(x))


def test_fake_quantize_dynamic_recomputes_per_token_and_cannot_export() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8", granularity=PerChannel(0), qparams_calculator="dynamic"))
    tokens = torch.tensor([[1.0, -0.5], [127.5, 12.5]])
    y = fq(tokens)
    # token 1: scale 1 -> 127.5 rounds to 128 and clamps to 127; 12.5 rounds half to even to 12
    assert y[1].tolist() == [127.0, 12.0]
    assert fq(torch.randn(9, 2)).shape == (9, 2)
    with pytest.raises(RuntimeError, match="cannot be frozen for export"):
        fq.set_export_mode(True)


def test_fake_quantize_extra_repr() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8", qscheme="symmetric_with_clipping"))
    fq.set_name("fc.weight")
    text = repr(fq)
    assert "name='fc.weight'" in text and "quant_range=[-127, 127]" in text and "export_mode=False" in text
    assert fq.calculator.name == "fc.weight"
    assert fq.calculator.range_calculator.name == "fc.weight.MinMaxRangeCalculator"


def test_bias_fake_quantize_uses_derived_int32_scale() -> None:
    bq = BiasFakeQuantize()
    bias = torch.tensor([0.26, -1.0, 0.0625 * 2.5])
    # per-tensor: s = 0.25 * 0.25 = 0.0625 -> round(4.16) = 4, -16, round(2.5) = 2 (half to even)
    y = bq(bias, torch.tensor(0.25), torch.tensor(0.25))
    assert (y / 0.0625).tolist() == [4.0, -16.0, 2.0]
    # per-channel: s = 0.5 * [0.5, 0.25, 1.0]
    y = bq(bias, torch.tensor([0.5]), torch.tensor([0.5, 0.25, 1.0]))
    assert y.tolist() == [0.25, -1.0, 0.0]


def test_bias_fake_quantize_rejects_per_channel_input_scale_and_mismatched_weight_scale() -> None:
    bq = BiasFakeQuantize()
    bq.set_name("fc.bias")
    with pytest.raises(ValueError, match=r"fc\.bias: int32 bias needs a per-tensor input scale"):
        bq(torch.zeros(3), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"weight scale of shape \(4,\) cannot scale a bias of shape \(3,\)"):
        bq(torch.zeros(3), torch.tensor(1.0), torch.ones(4))


def test_quantize_dequantize_int32_clamps_to_float32_exact_bounds() -> None:
    y = quantize_dequantize(torch.tensor([1e10, -1e10]), torch.tensor(1.0), torch.tensor(0, dtype=torch.int32),
                            -(2**31), 2**31 - 1, 0, 0, "int32")
    assert y.tolist() == [2147483520.0, -2147483648.0]


def test_quantize_dequantize_rejects_non_float32_input() -> None:
    with pytest.raises(TypeError, match="needs float32 x and scale.*cast to float32"):
        quantize_dequantize(torch.ones(2, dtype=torch.float16), torch.tensor(1.0),
                            torch.tensor(0, dtype=torch.int32), -128, 127, 0, 0, "int8")


def test_quantize_dequantize_per_block_broadcasts_scale_over_blocks() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    scale = torch.tensor([[0.5, 0.25]])
    zp = torch.tensor([[1, -2]], dtype=torch.int32)
    y = quantize_dequantize(x, scale, zp, -8, 7, 1, 2, "int4")
    # block 0: q = 2 + 1 = 3 -> (3 - 1)·0.5 = 1; block 1: q = 4 - 2 = 2 -> 1.0
    assert y.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    y = quantize_dequantize(x * 4, scale, zp, -8, 7, 1, 2, "int4")
    # block 0: q = 8 + 1 -> 7 -> 3.0; block 1: 16 - 2 -> 7 -> 2.25
    assert y.tolist() == [[3.0, 3.0, 2.25, 2.25]]


def test_fake_quantize_reset_statistics_drops_pending_calibration() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="int8", qparams_calculator="global_minmax"))
    fq.enable_fake_quant(False)
    fq(torch.tensor([-100.0, 100.0]))  # e.g. the prepare-time example input
    fq.reset_statistics()
    fq(torch.tensor([-1.0, 2.0]))
    fq.commit()
    assert fq.calculator.scale.item() == torch.tensor(2 / 127.5).item()


def test_fake_quantize_public_qparams_accessor_is_live_and_statistics_go_through_the_module() -> None:
    fq = FakeQuantize(QuantizationSpec(dtype="uint8", qscheme="asymmetric"))
    assert fq.stateful and not fq.exports_dynamic and not fq.has_qparams and not fq.has_statistics
    fq.observe(torch.tensor([-1.0, 3.0]))
    assert fq.has_statistics and not fq.has_qparams
    fq.commit()
    scale, zero_point, minval = fq.get_qparams()
    assert (scale.item() * 255, zero_point.item()) == pytest.approx((4.0, 64))
    assert scale is fq.calculator.scale  # the live buffer: a later commit updates what a reader holds
    fq.reset_statistics()
    fq.observe(torch.tensor([-2.0, 6.0]))
    fq.commit()
    assert scale.item() * 255 == pytest.approx(8.0) and fq.get_qparams().scale is scale
    dynamic = FakeQuantize(QuantizationSpec(dtype="uint8", qscheme="asymmetric", qparams_calculator="dynamic"))
    assert not dynamic.stateful and not dynamic.has_statistics
    with pytest.raises(RuntimeError, match="caches no qparams"):
        dynamic.get_qparams()


def test_bias_fake_quantize_reads_the_current_scales_of_the_quantizers_it_is_given() -> None:
    x_fq = FakeQuantize(QuantizationSpec(dtype="uint8", qscheme="asymmetric"))
    w_fq = FakeQuantize(QuantizationSpec(dtype="int8", granularity=PerChannel(0)))
    x_fq.observe(torch.tensor([0.0, 2.55]))
    w_fq.observe(torch.tensor([[1.275, 0.0], [-0.6375, 0.1]]))
    x_fq.commit()
    w_fq.commit()
    bias = torch.tensor([0.26, -1.0])
    bq = BiasFakeQuantize()
    expected = bq(bias, x_fq.get_qparams().scale, w_fq.get_qparams().scale)
    assert torch.equal(bq(bias, x_fq, w_fq), expected)
    x_fq.observe(torch.tensor([0.0, 25.5]))  # the input scale moves (a QAT step): the derived scale follows
    x_fq.commit()
    assert torch.equal(bq(bias, x_fq, w_fq), bq(bias, x_fq.get_qparams().scale, w_fq.get_qparams().scale))
    assert not torch.equal(bq(bias, x_fq, w_fq), expected)
