"""``drop_requantizations``: a shared quantizer's identity call before another quantizer goes, so onnxruntime runs
the rounding eager computes instead of merging two Q/DQ pairs into one of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.graph.node_meta import get_meta


class _SplitRelu(nn.Module):
    """MobileViTV2's attention value: a ReLU on a split of a quantized projection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.conv(x).split(4, 1)
        return torch.relu(b), a


def _calibrated() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    torch.manual_seed(0)  # a seed where the ReLU's calibrated top lies above the conv output's grid
    model = _SplitRelu().eval()
    data = [torch.randn(8, 4, 5, 5) for _ in range(2)]
    # the ReLU asks for an activation spec of its own (equal numbers: global_minmax reads no averaging constant);
    # under the global spec it would share the conv's quantizer and no second one would follow the split
    config = co.QuantizerConfig.presets.w8a8()
    own = config.activation.model_copy(update={"averaging_constant": 0.02})
    config = config.set_op_kind("relu", co.OpConfig(activation=own))
    prepared = co.prepare(model, config, (data[0],))
    co.calibrate(prepared, data, progress=False)
    return prepared, data


def _onnxruntime_merge(a: nn.Module, b: nn.Module) -> tuple[float, int]:
    """The scale / zero point onnxruntime's DoubleQDQPairsRemover gives ``Q_a → DQ_a → Q_b → DQ_b`` (uint8)."""
    sa, sb = np.float32(a.calculator.scale), np.float32(b.calculator.scale)
    za, zb = int(a.calculator.zero_point), int(b.calculator.zero_point)
    lo = max(np.float32(-za) * sa, np.float32(-zb) * sb)
    hi = min(np.float32(255 - za) * sa, np.float32(255 - zb) * sb)
    scale = np.float32((hi - lo) / np.float32(255))
    return float(scale), int(np.round(-lo / scale))


def test_convert_drops_the_identity_call_and_the_file_has_no_double_pair(tmp_path: Path) -> None:
    prepared, data = _calibrated()
    converted = co.convert(prepared)
    calls = [str(n.target) for n in converted.graph.nodes if get_meta(n).quantizer is not None]
    assert calls.count("conv_output_fq") == 2  # the conv output and the split piece ``a``; ``b``'s call went
    graph = onnx.load(str(co.export_onnx(converted, (data[0],), tmp_path / "split.onnx"))).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    assert [n.name for n in graph.node if n.op_type == "QuantizeLinear"
            and producer.get(n.input[0]) == "DequantizeLinear"] == []


def test_convert_changes_no_output() -> None:
    prepared, data = _calibrated()
    converted = co.convert(prepared)
    for _, fq in fake_quantizers(prepared):
        fq.enable_observer(False)
    with torch.no_grad():
        for x in data:
            for got, expected in zip(converted(x), prepared(x), strict=True):
                assert torch.equal(got, expected)


def test_onnxruntime_computes_the_relu_codes_eager_computes(tmp_path: Path) -> None:
    prepared, data = _calibrated()
    converted = co.convert(prepared)
    modules = dict(converted.named_modules())
    relu_fq = modules["relu_output_fq"]
    # the pair onnxruntime would have merged lands on another scale: the test sees the difference
    assert _onnxruntime_merge(modules["conv_output_fq"], relu_fq) == (0.008403078652918339, 0)
    assert float(relu_fq.calculator.scale) == 0.008426539599895477
    session = ort.InferenceSession(str(co.export_onnx(converted, (data[0],), tmp_path / "split.onnx")),
                                   providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for x in data:
            relu, _ = converted(x)
            got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
            np.testing.assert_array_equal(got, relu.numpy())  # with the pair left: 466 of 800 differ
