"""Quantizers owned per edge: readers of one tensor that want different specs each get their own quantizer.

The repro of issue 16: linears ``a`` and ``b`` read one input ``x``; ``w8a8`` with ``b`` set to uint16 used to give
ONE uint8 ``x`` quantizer for both (no warning, invisible in the summary).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx, nn

import coreai_opt
from coreai_opt.config import OpConfig, QuantizerConfig
from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize

W8A8 = QuantizerConfig.presets.w8a8
UINT16 = W8A8().activation.model_copy(update={"dtype": "uint16"})


class _TwoReaders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _NormThenReaders(nn.Module):
    """``a`` reads the LayerNorm output (quantized by the LayerNorm), ``b`` reads it through a reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.ln(x)
        return self.a(y), self.b(y.reshape(-1, 2, 4))


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmax: int) -> torch.Tensor:
    """``(clamp(round(x / s) + z, 0, qmax) − z) · s``: the asymmetric fake quantization, written out."""
    return (torch.clamp(torch.round(x / scale) + zero_point, 0, qmax) - zero_point) * scale


def _data() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(64, 4) * torch.tensor([1.0, 3.0, 0.5, 2.0])


def _prepared(model: nn.Module, config: QuantizerConfig, x: torch.Tensor) -> fx.GraphModule:
    prepared = coreai_opt.prepare(model.eval(), config, (x[:2],))
    coreai_opt.calibrate(prepared, [x], progress=False)
    return prepared


def _rows(prepared: fx.GraphModule) -> dict:
    return {r.serves: r for r in coreai_opt.summary(prepared).quantizers}


def _b_in_uint16() -> QuantizerConfig:
    return W8A8().set_module_name("b", OpConfig(activation=UINT16))


def _calls(gm: fx.GraphModule, module: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target == module]


def test_readers_wanting_different_specs_get_one_quantizer_each_with_its_own_scale() -> None:
    x = _data()
    prepared = _prepared(_TwoReaders(), _b_in_uint16(), x)
    u8, u16 = _rows(prepared)["x.input"], _rows(prepared)["x.input@b"]
    assert (u8.consumers, u16.consumers) == (("a",), ("b",))
    fq8, fq16 = prepared.get_submodule(u8.module), prepared.get_submodule(u16.module)
    assert (fq8.spec.dtype, fq16.spec.dtype) == ("uint8", "uint16")
    # both read the float input (not one another): the scales come from the data, (max - min) / (2^bits - 1)
    assert [n.args[0].op for n in _calls(prepared, u8.module) + _calls(prepared, u16.module)] == ["placeholder"] * 2
    assert torch.equal(fq8.get_qparams().scale, (x.max() - x.min()) / 255)
    assert torch.equal(fq16.get_qparams().scale, (x.max() - x.min()) / 65535)
    assert int(fq16.get_qparams().zero_point) == int(torch.round(-x.min() / ((x.max() - x.min()) / 65535)))
    # b's output is the uint16 computation, exactly: 16-bit input, int8 weight, int32 bias with s_in = s16
    with torch.no_grad():
        s16, z16, _ = fq16.get_qparams()
        x16 = _fake_quant(x, s16, z16, 65535)
        w = prepared.get_submodule("b_weight_fq")(prepared.get_submodule("b").weight)
        s_b = s16 * prepared.get_submodule("b_weight_fq").get_qparams().scale
        bias = torch.round(prepared.get_submodule("b").bias / s_b) * s_b
        s_out, z_out, _ = prepared.get_submodule("b_output_fq").get_qparams()
        expected = _fake_quant(nn.functional.linear(x16, w, bias), s_out, z_out, 65535)
        out_a, out_b = prepared(x)
    assert torch.equal(out_b, expected)
    x8 = _fake_quant(x, *fq8.get_qparams()[:2], 255)
    assert not torch.equal(nn.functional.linear(x8, w, bias), nn.functional.linear(x16, w, bias))  # 8 bits differ
    bias_call = next(n for n in prepared.graph.nodes if get_meta(n).quantizer is not None
                     and get_meta(n).quantizer.serves == "b.bias")
    assert [a.target for a in bias_call.args[1:]] == [u16.module, "b_weight_fq"]  # s_b = s16 · s_w
    text = str(coreai_opt.summary(prepared))
    assert "x.input@b" in text and "consumers" in text.splitlines()[1]


def test_readers_wanting_the_same_spec_share_one_quantizer() -> None:
    prepared = _prepared(_TwoReaders(), W8A8(), _data())
    fake_quantizers = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    assert len(fake_quantizers) == 5  # x, a.weight, b.weight, a.output, b.output
    assert sum(isinstance(m, BiasFakeQuantize) for m in prepared.modules()) == 2
    rows = _rows(prepared)
    assert rows["x.input"].consumers == ("a", "b") and "x.input@b" not in rows


def test_split_quantizer_exports_and_onnxruntime_agrees(tmp_path: Path) -> None:
    x = _data()
    prepared = _prepared(_TwoReaders(), _b_in_uint16(), x)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, (x[:2],), tmp_path / "split.onnx")
    report = verify_onnx(converted, path, [x[:16], x[16:]])
    print(report)
    assert report.ok, str(report)


def test_reader_of_a_quantized_output_wanting_another_spec_quantizes_the_float_output() -> None:
    x = _data()
    prepared = _prepared(_NormThenReaders(), _b_in_uint16(), x)
    own, split = _rows(prepared)["ln.output"], _rows(prepared)["ln.output@b"]
    assert (own.consumers, split.consumers) == (("a", "reshape"), ("b",))
    (call,) = _calls(prepared, split.module)
    replay = call.args[0]  # the reshape, replayed on the float LayerNorm output
    assert replay.target == "reshape" and replay.args[0].op == "call_module" and replay.args[0].target == "ln"
    fq16 = prepared.get_submodule(split.module)
    with torch.no_grad():
        y = prepared.get_submodule("ln")(x)
    assert torch.equal(fq16.get_qparams().scale, (y.max() - y.min()) / 65535)
    assert torch.equal(prepared.get_submodule(own.module).get_qparams().scale, (y.max() - y.min()) / 255)


def test_edges_wanting_the_same_spec_of_a_quantized_output_share_it() -> None:
    prepared = _prepared(_NormThenReaders(), W8A8(), _data())
    rows = _rows(prepared)
    assert not any("@" in serves for serves in rows)
    # the LayerNorm output quantizer, called after the LayerNorm and again where the reshape leaves its group
    assert [n.args[0].name for n in _calls(prepared, rows["ln.output"].module)] == ["ln", "reshape"]
    assert get_meta(_calls(prepared, rows["ln.output"].module)[0]).quantizer.role is Role.ACTIVATION


def test_the_uint16_reader_gets_16_bit_precision_and_a_smaller_error_than_the_uint8_reader() -> None:
    torch.manual_seed(0)
    x = _data()
    model = _TwoReaders().eval()
    model.b.load_state_dict(model.a.state_dict())  # the same layer twice: only the precision asked for differs
    prepared = _prepared(model, _b_in_uint16(), x)
    rows = _rows(prepared)
    fq8, fq16 = prepared.get_submodule(rows["x.input"].module), prepared.get_submodule(rows["x.input@b"].module)
    assert (fq16.spec.quant_min, fq16.spec.quant_max) == (0, 65535) and (fq8.spec.quant_min, fq8.spec.quant_max) == (
        0, 255)
    with torch.no_grad():
        reference = model.a(x)
        out_a, out_b = prepared(x)
        input_error_8, input_error_16 = (fq8(x) - x).abs().max(), (fq16(x) - x).abs().max()
    # each input quantizer rounds to its own step: at most half a step off, 257x finer at 16 bits
    assert input_error_8 <= fq8.get_qparams().scale / 2 + 1e-7 and input_error_16 <= fq16.get_qparams().scale / 2 + 1e-7
    assert input_error_16 < input_error_8 / 200
    # measured: max |error| 0.0341 (a, uint8) vs 0.0145 (b, uint16), mean squared 1.58e-4 vs 1.28e-5; what is
    # left in b is the int8 weight's error, which both layers share
    mse_a, mse_b = (out_a - reference).pow(2).mean(), (out_b - reference).pow(2).mean()
    assert mse_b < mse_a / 10
    assert (out_b - reference).abs().max() < (out_a - reference).abs().max() / 2
