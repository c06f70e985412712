"""Weight rounding through prepare → calibrate → convert → export_onnx: statistics edges, repeatability, ONNX."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.spec import PerBlock, QuantizationSpec


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 64, 1)
        self.fc1 = nn.Linear(64, 96)
        self.fc2 = nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 4, seq]
        h = self.conv(x).transpose(1, 2)
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().eval()


def _data(n: int = 6, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(4, 4, generator=gen)
    return [(torch.randn(8, 16, 4, generator=gen) @ mixing).transpose(1, 2).contiguous() for _ in range(n)]


def _config(rounding: str, qscheme: str = "asymmetric") -> QuantizerConfig:
    spec = QuantizationSpec(dtype="int4", qscheme=qscheme, granularity=PerBlock(axis=1, block_size=32),
                            weight_rounding=rounding)
    return QuantizerConfig(weight=spec, activation=None, int32_bias=False, per_block_fallback="per_channel")


def _roundings(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return {fq.name: fq.rounding.qweight.clone() for _, fq in fake_quantizers(gm)}


def test_statistics_observe_only_the_linear_input_edges_and_change_no_value() -> None:
    model, data = _model(), _data()
    prepared = co.prepare(model, _config("gptq"), (data[0],))
    calls = [n.target for n in prepared.graph.nodes if n.op == "call_module" and n.target.endswith(".statistics")]
    assert calls == ["fc1_weight_fq.rounding.statistics", "fc2_weight_fq.rounding.statistics"]
    assert not prepared.conv_weight_fq.rounding.statistics.attached  # conv: data-free path
    stats = prepared.fc1_weight_fq.rounding.statistics
    stats.enabled = True
    with torch.no_grad():
        prepared(data[0])
    assert isinstance(stats, InputStatistics) and int(stats.count) == 8 * 16 and stats.xtx.shape == (64, 64)


def test_gptq_calibration_is_repeatable_releases_the_hessians_and_leaves_the_model_untouched() -> None:
    model, data = _model(), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepared = co.prepare(model, _config("gptq"), (data[0],))
    data_free = _roundings(prepared)  # before calibration: the provisional round-to-nearest (GPTQ needs the Hessians)
    co.calibrate(prepared, data, progress=False)
    first = _roundings(prepared)
    assert prepared.fc1_weight_fq.rounding.statistics.xtx.numel() == 0  # released after use
    co.calibrate(prepared, data, progress=False)
    second = _roundings(prepared)
    assert all(torch.equal(first[k], second[k]) for k in first)
    changed = (first["fc1.weight"] != data_free["fc1.weight"]).float().mean().item()
    assert changed > 0.05  # GPTQ really moved integers away from the data-free rounding
    assert torch.equal(first["conv.weight"], data_free["conv.weight"])  # no input statistics: data-free path
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gptq_lowers_the_model_output_error_against_rtn() -> None:
    model, data = _model(), _data()
    errors = {}
    for rounding in ("rtn", "gptq"):
        prepared = co.prepare(model, _config(rounding), (data[0],))
        co.calibrate(prepared, data, progress=False)
        converted = co.convert(prepared)
        with torch.no_grad():
            errors[rounding] = sum(float((converted(x) - model(x)).square().mean()) for x in _data(4, seed=9))
    assert errors["gptq"] / errors["rtn"] < 0.8


def test_convert_refuses_gptq_that_never_saw_calibration_data() -> None:
    prepared = co.prepare(_model(), _config("gptq"), (_data()[0],))
    with pytest.raises(ValueError, match=r"never observed .*fc1\.weight.*run coreai_opt\.calibrate"):
        co.convert(prepared)
    co.convert(co.prepare(_model(), _config("hqq"), (_data()[0],)))  # data-free: fine without calibration


def _unpacked_int4(node: onnx.NodeProto, proto: onnx.ModelProto) -> np.ndarray:
    """The signed int4 ``[N, K]`` weight of a MatMulNBits node (low nibble first, stored + 8)."""
    attrs = {a.name: a.i for a in node.attribute}
    packed = next(numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == node.input[1])
    values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(attrs["N"], -1)[:, : attrs["K"]]
    return values.astype(np.int16) - 8


@pytest.mark.parametrize("rounding", ["gptq", "hqq"])
def test_exported_int4_weights_are_the_eager_integers_and_onnxruntime_matches_eager(rounding: str, tmp_path) -> None:
    model, data = _model(), _data()
    prepared = co.prepare(model, _config(rounding), (data[0],))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (data[0],), tmp_path / "m.onnx")
    proto = onnx.load(str(path))
    dq_inputs = {n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    int4 = [numpy_helper.to_array(t) for t in proto.graph.initializer
            if t.data_type == onnx.TensorProto.INT4 and t.name in dq_inputs]
    int4 += [_unpacked_int4(n, proto) for n in proto.graph.node if n.op_type == "MatMulNBits"]  # 3-D linears
    eager = {tuple(fq.rounding.qweight.shape): fq.rounding.qweight.numpy()
             for _, fq in fake_quantizers(converted)}
    assert len(int4) == 3
    for array in int4:  # stored as [out, in] or transposed [in, out] for MatMul
        match = eager.get(array.shape)
        match = match if match is not None else eager[array.T.shape].T
        assert np.array_equal(array.astype(np.int8), match)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")  # keep fp32 compute
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = _data(1, seed=5)[0]
    with torch.no_grad():
        expected = converted(x).numpy()
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert float(np.abs(got - expected).max()) < 1e-4 * float(np.abs(expected).max())
