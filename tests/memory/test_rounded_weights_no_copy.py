"""Rounded weights (GPTQ, RTN, ...) cost no float copy of every weight in export / verify, and GPTQ's memory-lean
arithmetic gives the same bits (issue 20).

Before: the first export-mode forward (``export_onnx``'s output count) cached every rounded weight's float32
``(q − z)·s`` on the converted model for good (+1.0x of the linear weights through export and verify), and GPTQ's
in-place Cholesky chain, lazy-block update and float32 integer buffer each held an extra weight- or Hessian-sized
temporary.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.onnx.export import export_onnx as export_module
from coreai_opt.onnx.export import rounded_weights
from coreai_opt.quantization.rounding import gptq as rounding_gptq
from coreai_opt.quantization.rounding.gptq import GPTQRounding, inverse_hessian_factor
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.weight_rounding import RTNRounding, WeightRoundingBase
from coreai_opt.quantization.spec import PerBlock, PerChannel, PerTensor, QuantizationSpec


def _converted_w4() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.Linear(256, 8)).eval()
    x = torch.randn(4, 512)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w4(algorithm="rtn"), (x,))
    co.calibrate(prepared, [x], progress=False)
    return co.convert(prepared), x


def _roundings(model: nn.Module) -> list[WeightRoundingBase]:
    return [m for m in model.modules() if isinstance(m, WeightRoundingBase)]


def test_an_export_mode_forward_keeps_no_rounded_weight_copy() -> None:
    converted, x = _converted_w4()
    converted(x)
    roundings = _roundings(converted)
    assert len(roundings) == 3 and all(r.has_result and r.export_weight is None for r in roundings)


def test_lazy_rounded_weights_export_the_same_bytes_and_leave_no_copy(tmp_path, monkeypatch) -> None:
    converted, x = _converted_w4()
    lazy = co.export_onnx(converted, (x,), tmp_path / "lazy.onnx").read_bytes()
    assert all(r.export_weight is None for r in _roundings(converted))
    # the two large weights (2 MiB and 1 MiB of float32) were placeholders: bound lazily, not materialised
    seen: list[int] = []
    bind = rounded_weights.bind_rounded_weights

    def counting(model, placeholders):  # noqa: ANN001, ANN202
        seen.append(len(placeholders))
        return bind(model, placeholders)

    monkeypatch.setattr(export_module, "bind_rounded_weights", counting)
    assert co.export_onnx(converted, (x,), tmp_path / "again.onnx").read_bytes() == lazy
    assert seen == [2]
    materialised = rounded_weights.rounded_weight_buffers.__wrapped__

    def eager(model, lazy):  # noqa: ANN001, ANN202, ARG001 (every buffer materialised: the former behaviour)
        return rounded_weights.contextmanager(materialised)(model, False)

    monkeypatch.setattr(export_module, "rounded_weight_buffers", eager)
    assert co.export_onnx(converted, (x,), tmp_path / "real.onnx").read_bytes() == lazy
    assert co.verify_onnx(converted, tmp_path / "lazy.onnx", [x]).ok


def test_a_placeholder_missing_from_the_exported_model_is_an_error() -> None:
    converted, _ = _converted_w4()
    import onnx_ir as ir

    with rounded_weights.rounded_weight_buffers(converted, lazy=True) as placeholders:
        assert len(placeholders) == 2
        with pytest.raises(CoreaiOptRuntimeError, match="no initializer for the rounded weights"):
            rounded_weights.bind_rounded_weights(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), placeholders)
    assert all(r.export_weight is None for r in _roundings(converted))


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(0), PerChannel(1), PerBlock(1, 8), PerBlock(0, 8)])
def test_chunked_dequantize_is_bit_exact(granularity, monkeypatch) -> None:
    torch.manual_seed(1)
    spec = QuantizationSpec(dtype="int4", granularity=granularity)
    rounding = RTNRounding(spec)
    weight = torch.randn(48, 64)
    rounding.commit(weight)
    q = rounding.qweight.float()
    formula = (q - granularity.expand(rounding.zero_point.float(), q)) * granularity.expand(rounding.scale, q)
    monkeypatch.setattr("coreai_opt.quantization.rounding.weight_rounding._ROW_CHUNK", 100)  # many chunks
    assert torch.equal(rounding.dequantized().view(torch.int32), formula.view(torch.int32))


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(0), PerChannel(1), PerBlock(1, 8), PerBlock(0, 8)])
@pytest.mark.parametrize("rows", [slice(0, 48), slice(0, 8), slice(8, 24), slice(40, 48), slice(3, 5)])
def test_dequantized_rows_are_the_rows_of_the_whole_dequantized_weight_bit_for_bit(granularity, rows) -> None:
    torch.manual_seed(1)
    rounding = RTNRounding(QuantizationSpec(dtype="int4", granularity=granularity))
    rounding.commit(torch.randn(48, 64))
    whole = rounding.dequantized()[rows]
    assert torch.equal(rounding.dequantized_rows(rows).view(torch.int32), whole.view(torch.int32))


def test_the_fold_reads_a_rounded_weight_by_rows_never_whole(tmp_path, monkeypatch) -> None:
    converted, x = _converted_w4()
    reference = co.export_onnx(converted, (x,), tmp_path / "a.onnx").read_bytes()
    whole: list[int] = []
    original = WeightRoundingBase.dequantized

    def counting(self):  # noqa: ANN001, ANN202
        whole.append(1)
        return original(self)

    monkeypatch.setattr(WeightRoundingBase, "dequantized", counting)
    assert co.export_onnx(converted, (x,), tmp_path / "b.onnx").read_bytes() == reference
    assert whole == [1]  # only the small third weight (below the prequantize size) was read whole, for the trace


def test_in_place_inverse_hessian_factor_is_the_reference_bit_for_bit() -> None:
    torch.manual_seed(2)
    x = torch.randn(300, 96)
    hessian = x.T @ x
    hessian[5] = 0.0
    hessian[:, 5] = 0.0  # a dead input
    h = hessian.double()
    h[5, 5] = 1.0
    h.diagonal().add_(0.01 * float(h.diagonal().mean()))
    reference = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    factor = inverse_hessian_factor(hessian, 0.01)
    assert torch.equal(factor, reference)
    assert torch.equal(hessian[5], torch.zeros(96))  # the caller's Hessian is not modified


def test_gptq_row_chunked_update_gives_the_same_integers(monkeypatch) -> None:
    torch.manual_seed(3)
    weight = torch.randn(200, 256)
    x = torch.randn(512, 256)

    def rounded() -> tuple[torch.Tensor, torch.Tensor]:
        rounding = GPTQRounding(QuantizationSpec(dtype="int4", granularity=PerBlock(1, 32)))
        stats = InputStatistics(hessian=True)
        stats.update(x)
        result = rounding.round_weight(weight, stats)
        return result.q, result.scale

    whole = rounded()
    monkeypatch.setattr(rounding_gptq, "_UPDATE_CHUNK", 1000)  # about 8 rows a part
    chunked = rounded()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert int(whole[0].min()) >= -8 and int(whole[0].max()) <= 7


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(0), PerChannel(1), PerBlock(1, 8), PerBlock(0, 8)])
@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_row_chunked_round_to_nearest_is_bit_exact(granularity, qscheme, monkeypatch) -> None:
    torch.manual_seed(4)
    weight = torch.randn(48, 64)
    spec = QuantizationSpec(dtype="int4", granularity=granularity, qscheme=qscheme)
    whole = RTNRounding(spec).round_weight(weight, None)
    monkeypatch.setattr("coreai_opt.quantization.rounding.weight_rounding._ROW_CHUNK", 100)
    chunked = RTNRounding(spec).round_weight(weight, None)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
    assert whole.q.dtype == torch.int32 and int(whole.q.min()) >= -8 and int(whole.q.max()) <= 7


@pytest.mark.parametrize(("shape", "axis", "block"), [((64, 96), 1, 32), ((64, 96), 0, 16), ((8, 48, 5), 1, 16)])
@pytest.mark.parametrize("dtype", ["int4", "float8_e4m3fn"])
def test_per_block_fake_quantization_on_the_blocked_view_is_bit_exact(shape, axis, block, dtype) -> None:
    from coreai_opt.quantization.ops.quantize_dequantize_op import quantize_dequantize

    torch.manual_seed(5)
    x = torch.randn(shape) * 3
    qshape = list(shape)
    qshape[axis] //= block
    scale = torch.rand(qshape) * 0.3 + 0.01
    zero = torch.randint(-3, 3, qshape, dtype=torch.int32)
    if dtype != "int4":
        zero = torch.zeros_like(zero)
    s = scale.repeat_interleave(block, dim=axis)  # the qparams repeated to the size of x: the formula as written
    z = zero.repeat_interleave(block, dim=axis)
    if dtype == "int4":
        expected = (torch.clamp(torch.round(x / s) + z, -8, 7) - z) * s
        got = quantize_dequantize(x, scale, zero, -8, 7, axis, block, dtype)
    else:
        expected = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        got = quantize_dequantize(x, scale, zero, -448, 448, axis, block, dtype)
    assert got.shape == x.shape and torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_calibrates_rollback_snapshot_keeps_the_rounding_results_by_reference() -> None:
    from coreai_opt.api.internals.quantizer_snapshot import QuantizerSnapshot

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64)).eval()
    x = torch.randn(8, 256)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w4(algorithm="gptq"), (x,))
    roundings = _roundings(prepared)
    integers = sum(r.qweight.numel() * r.qweight.element_size() for r in roundings)
    assert integers == 256 * 512 + 512 * 64
    co.calibrate(prepared, [x], progress=False)  # GPTQ results: no longer provisional, so saved by reference
    snapshot = QuantizerSnapshot(prepared)
    assert snapshot.nbytes == 102440 < integers  # before: 307240, the roundings' integers and qparams cloned
    before = [r.qweight for r in roundings]
    co.calibrate(prepared, [2 * x], progress=False)
    assert all(r.qweight is not b for r, b in zip(roundings, before, strict=True))  # replaced, not written
    snapshot.restore()
    assert all(r.qweight is b for r, b in zip(roundings, before, strict=True))
