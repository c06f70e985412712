from __future__ import annotations

import pytest
import torch

from coreai_opt.quantization.spec import SCALE_EPS, compute_qparams, get_dtype_info, quant_range

# Hand-computed qparams of the range [-1, 3]: max_abs = 3, max - min = 4.
#   symmetric:   scale = 3 / ((qmax - qmin) / 2), zp = (qmin + qmax + 1) // 2
#   clipping:    signed range [-qmax, qmax] -> scale = 3 / qmax, zp = 0 (unsigned: same as symmetric)
#   asymmetric:  scale = 4 / (qmax - qmin), zp = qmin - round(-1 / scale)
#   float8:      scale = 3 / finfo.max
# (dtype, scheme): (scale, zero_point, minval = (qmin - zp) * scale)
EXPECTED = {
    ("int8", "symmetric"): (3 / 127.5, 0, -128 * 3 / 127.5),
    ("int8", "symmetric_with_clipping"): (3 / 127, 0, -3.0),
    ("int8", "asymmetric"): (4 / 255, -64, -64 * 4 / 255),  # round(-63.75) = -64
    ("uint8", "symmetric"): (3 / 127.5, 128, -128 * 3 / 127.5),
    ("uint8", "symmetric_with_clipping"): (3 / 127.5, 128, -128 * 3 / 127.5),
    ("uint8", "asymmetric"): (4 / 255, 64, -64 * 4 / 255),
    ("int16", "symmetric"): (3 / 32767.5, 0, -32768 * 3 / 32767.5),
    ("int16", "symmetric_with_clipping"): (3 / 32767, 0, -3.0),
    ("int16", "asymmetric"): (4 / 65535, -16384, -16384 * 4 / 65535),  # round(-16383.75) = -16384
    ("uint16", "symmetric"): (3 / 32767.5, 32768, -32768 * 3 / 32767.5),
    ("uint16", "symmetric_with_clipping"): (3 / 32767.5, 32768, -32768 * 3 / 32767.5),
    ("uint16", "asymmetric"): (4 / 65535, 16384, -16384 * 4 / 65535),
    ("int4", "symmetric"): (0.4, 0, -3.2),
    ("int4", "symmetric_with_clipping"): (3 / 7, 0, -3.0),
    ("int4", "asymmetric"): (4 / 15, -4, -4 * 4 / 15),  # round(-3.75) = -4
    ("uint4", "symmetric"): (0.4, 8, -3.2),
    ("uint4", "symmetric_with_clipping"): (0.4, 8, -3.2),
    ("uint4", "asymmetric"): (4 / 15, 4, -4 * 4 / 15),
    ("float8_e4m3fn", "symmetric"): (3 / 448, None, None),
    ("float8_e4m3fn", "symmetric_with_clipping"): (3 / 448, None, None),
    ("float8_e5m2", "symmetric"): (3 / 57344, None, None),
    ("float8_e5m2", "symmetric_with_clipping"): (3 / 57344, None, None),
}


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@pytest.mark.parametrize(("dtype", "scheme"), list(EXPECTED))
def test_compute_qparams_per_tensor_exact_values(dtype: str, scheme: str) -> None:
    scale, zp, minval = compute_qparams(_f32(-1.0), _f32(3.0), get_dtype_info(dtype), scheme)
    exp_scale, exp_zp, exp_minval = EXPECTED[dtype, scheme]
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert scale.item() == _f32(exp_scale).item()  # correctly rounded: both operands are exact in float32
    if exp_zp is None:
        assert zp is None and minval is None
    else:
        assert zp.dtype == torch.int32 and zp.item() == exp_zp
        assert minval.item() == pytest.approx(exp_minval, rel=1e-6)


@pytest.mark.parametrize(("dtype", "scheme"), list(EXPECTED))
@pytest.mark.parametrize("qparam_shape", [(5,), (5, 1)], ids=["per_channel", "per_block"])
def test_compute_qparams_grouped_exact_values(dtype: str, scheme: str, qparam_shape: tuple[int, ...]) -> None:
    """Rows k = 0..3 hold the range [-1, 3]·2^k (power-of-two scaling is exact); row 4 is all zero."""
    factors = torch.tensor([1.0, 2.0, 4.0, 8.0, 0.0])
    min_val = (-1.0 * factors).reshape(qparam_shape)
    max_val = (3.0 * factors).reshape(qparam_shape)
    info = get_dtype_info(dtype)
    scale, zp, minval = compute_qparams(min_val, max_val, info, scheme)
    exp_scale, exp_zp, _ = EXPECTED[dtype, scheme]
    expected_scale = torch.tensor([exp_scale, 2 * exp_scale, 4 * exp_scale, 8 * exp_scale, SCALE_EPS])
    assert scale.shape == qparam_shape
    assert torch.equal(scale.flatten(), expected_scale)
    if exp_zp is None:
        assert zp is None
        return
    qmin, qmax = quant_range(info, scheme)
    zero_row_zp = qmin if scheme == "asymmetric" else (qmin + qmax + 1) // 2
    assert zp.flatten().tolist() == [exp_zp] * 4 + [zero_row_zp]
    assert torch.equal(minval, (qmin - zp).float() * scale)


def test_compute_qparams_range_always_includes_zero() -> None:
    info = get_dtype_info("uint8")
    scale, zp, _ = compute_qparams(_f32(1.0), _f32(2.55), info, "asymmetric")
    assert scale.item() == _f32(2.55 / 255).item()  # min is pulled down to 0
    assert zp.item() == 0
    scale, zp, _ = compute_qparams(_f32(-2.55), _f32(-1.0), info, "asymmetric")
    assert scale.item() == _f32(2.55 / 255).item()
    assert zp.item() == 255


def test_compute_qparams_all_zero_range_gives_eps_scale() -> None:
    for dtype, scheme in (("int8", "symmetric"), ("uint8", "asymmetric"), ("float8_e4m3fn", "symmetric")):
        scale, _, _ = compute_qparams(torch.zeros(3), torch.zeros(3), get_dtype_info(dtype), scheme)
        assert torch.equal(scale, torch.full((3,), torch.finfo(torch.float32).eps))


def test_compute_qparams_treats_infinite_bounds_as_zero_width() -> None:
    """Rows where no finite value was seen arrive as (+inf, -inf) and give the eps scale, never NaN."""
    min_val = torch.tensor([float("inf"), -1.0])
    max_val = torch.tensor([float("-inf"), 3.0])
    scale, zp, minval = compute_qparams(min_val, max_val, get_dtype_info("int8"), "asymmetric")
    assert scale.tolist() == [SCALE_EPS, _f32(4 / 255).item()]
    assert zp.tolist() == [-128, -64]
    assert bool(torch.isfinite(minval).all())


def test_compute_qparams_raises_on_nan_bounds() -> None:
    with pytest.raises(ValueError, match="NaN in max_val"):
        compute_qparams(_f32(-1.0), _f32(float("nan")), get_dtype_info("int8"), "symmetric")


def test_compute_qparams_rejects_asymmetric_float8() -> None:
    with pytest.raises(ValueError, match="use qscheme='symmetric'"):
        compute_qparams(_f32(-1.0), _f32(1.0), get_dtype_info("float8_e4m3fn"), "asymmetric")


def test_compute_qparams_zero_point_saturates_in_dtype_range() -> None:
    # A tiny positive max with a large negative min pushes the ideal zero point to qmax for uint8.
    _, zp, _ = compute_qparams(_f32(-255.0), _f32(1e-9), get_dtype_info("uint8"), "asymmetric")
    assert zp.item() == 255


def test_quant_range_table() -> None:
    assert quant_range(get_dtype_info("int4"), "symmetric") == (-8, 7)
    assert quant_range(get_dtype_info("int4"), "symmetric_with_clipping") == (-7, 7)
    assert quant_range(get_dtype_info("uint4"), "symmetric_with_clipping") == (0, 15)
    assert quant_range(get_dtype_info("float8_e5m2"), "symmetric_with_clipping") == (-57344.0, 57344.0)


def test_docstring_examples_of_the_spec_layer_run() -> None:
    import doctest

    from coreai_opt.quantization.fake_quantize import bias_fake_quantize
    from coreai_opt.quantization.spec import dtypes, qparams_math, spec

    for module in (qparams_math, spec, bias_fake_quantize, dtypes):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
