"""relu / relu6 / hardtanh quantize their output only, once: behind a float op the tensor is rounded once, and on an
already quantized tensor the clamp reuses its grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.graph.node_meta import get_meta


class _PreActivation(nn.Module):
    """DenseNet's pre-activation: a BatchNorm no conv precedes (it normalises a concatenation), then timm's
    ``drop`` (Identity) and the ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.drop = nn.BatchNorm2d(8), nn.Identity()
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, 8))
            self.bn.bias.copy_(torch.linspace(0.3, -0.3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.bn(torch.cat([x, x.flip(1)], 1))))


def test_a_relu_behind_a_float_batchnorm_gets_only_its_output_quantizer_and_onnxruntime_agrees(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(16, 4, 6, 6) for _ in range(3)]
    prepared = co.prepare(_PreActivation().eval(), co.QuantizerConfig.presets.w8a8(), (data[0],))
    assert [get_meta(n).quantizer.serves for n in prepared.graph.nodes if get_meta(n).quantizer is not None] == [
        "x.input", "flip.output", "cat.output", "relu.output"]  # none between the BatchNorm and the ReLU
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (data[0],), tmp_path / "pre.onnx")
    producer = {out: n.op_type for n in onnx.load(str(path)).graph.node for out in n.output}
    assert "BatchNormalization" in producer.values()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for x in data:
            got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
            # measured: 0 of 4608 differ; with the BatchNorm output quantized too, onnxruntime merged its Q/DQ
            # pair with the ReLU's into one rounding while eager rounded twice
            np.testing.assert_array_equal(got, converted(x).numpy())


class _ConcatThenRelu(nn.Module):
    """EfficientViT-MSRA's attention tail: the heads' outputs concatenated, then ``proj = ReLU → conv``."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right, self.proj = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.right.bias.add_(0.5)  # the two halves' ranges differ, so the cat's range is not a ReLU's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(torch.cat([x @ torch.ones(6, 6) / 6 - 0.2, self.right(x)], 1)))


def test_a_relu_on_an_already_quantized_tensor_shares_its_quantizer_and_onnxruntime_equals_eager(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(16, 4, 6, 6) for _ in range(3)]
    prepared = co.prepare(_ConcatThenRelu().eval(), co.QuantizerConfig.presets.w8a8(), (data[0],))
    calls = {n.name: str(n.target) for n in prepared.graph.nodes if get_meta(n).quantizer is not None}
    relu_call = next(n for n in prepared.graph.nodes if n.op == "call_function" and "relu" in str(n.target))
    (reader,) = relu_call.users
    cat_call = relu_call.args[0]
    assert reader.target == cat_call.target and reader.name in calls  # one grid: the cat's quantizer again
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (data[0],), tmp_path / "cat_relu.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for x in data:
            got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
            # measured: with the ReLU's own quantizer 325 of 2304 outputs differed (onnxruntime merged the two pairs)
            np.testing.assert_allclose(got, converted(x).numpy(), rtol=0, atol=1e-6)
    report = co.verify_onnx(converted, path, [(x,) for x in data])
    assert report.ok, report
