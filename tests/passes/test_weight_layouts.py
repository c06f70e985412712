"""A weight quantizer is laid out like the tensor its layer reads (issue 30, classes 2 and 3).

NFNet's ``ScaledStdConv2d`` (timm) standardises its weight every call with ``F.batch_norm`` over a ``[1, C, K]``
view and reshapes it back. The per-channel weight quantizer used to sit on the ``[1, C, K]`` view (channel axis 0
has size 1) and calibration failed with "qparam shape changed from (1,) to (16,)". Rule 4 of
:mod:`coreai_opt.graph.quantizer_groups`: a per-channel request is split off a group of value-moving views, so
its quantizer reads exactly the tensor the conv reads.

``nn.MultiheadAttention`` as an attention-pooling head (a learned probe query attending over the tokens, SigLIP's
MAP head) splits its packed ``in_proj_weight`` into ``w_q`` and ``w_kv`` rows because the query is not the key.
The ``[3E, E]`` per-channel quantizer was replayed on both slices and failed with "The size of tensor a (128)
must match the size of tensor b (384)"; each slice now has its own quantizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from coreai_opt.api import calibrate, convert, prepare
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx


class _ScaledStdConv2d(nn.Conv2d):
    """timm's ``ScaledStdConv2d``: ``w' = gain · scale · (w − mean_c) / sqrt(var_c + eps)`` per output channel ``c``."""

    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__(cin, cout, k, padding=k // 2)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, cout).reshape(cout, 1, 1, 1))
        self.scale = (cin * k * k) ** -0.5
        self.eps = 1e-6

    def standardized_weight(self) -> torch.Tensor:
        return F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                            weight=(self.gain * self.scale).view(-1), training=True, momentum=0.0,
                            eps=self.eps).reshape_as(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding)


class _NfNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = _ScaledStdConv2d(3, 16, 3), _ScaledStdConv2d(16, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.relu(self.c1(x)))


class _TransposedSquareWeight(nn.Module):
    """``F.linear(x, w.t())`` with a square ``w``: the output channels of the layer are the columns of ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.diag(torch.arange(1.0, 9.0)) + 0.01 * torch.ones(8, 8))
        self.w.data[0, 7] = 20.0  # column 7 (= output channel 7) holds the largest value; row 0 is row-wise largest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.t())


def _weight_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: fq.get_qparams().scale for name, fq in fake_quantizers(model) if "weight" in name
            or "batch_norm" in name or name.endswith("t_fq")}


def test_standardized_conv_weight_is_quantized_per_output_channel_of_the_conv(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _NfNet().eval()
    x = torch.randn(2, 3, 12, 12)
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), (x,))
    calibrate(prepared, [x, torch.randn(2, 3, 12, 12)], progress=False)
    converted = convert(prepared)
    for conv in (model.c1, model.c2):  # symmetric_with_clipping: scale_c = max_c |w'| / 127, exactly
        expected = conv.standardized_weight().detach().abs().amax(dim=(1, 2, 3)) / 127
        matches = [s for s in _weight_scales(converted).values() if s.shape == expected.shape
                   and torch.allclose(s, expected, rtol=1e-6, atol=0)]
        assert len(matches) == 1
    with torch.no_grad():
        ref, out = model(x), converted(x)
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    print(f"NFNet-style conv pair: {sqnr:.1f} dB against float")
    assert sqnr > 30.0
    path = tmp_path / "nfnet.onnx"
    export_onnx(converted, (x,), path)
    report = verify_onnx(converted, path, [(x,)])
    assert report.ok, report


def test_transposed_square_weight_gets_the_scale_of_each_output_channel() -> None:
    model = _TransposedSquareWeight().eval()
    x = torch.randn(4, 8)
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), (x,))
    calibrate(prepared, [x], progress=False)
    converted = convert(prepared)
    scales = [fq.get_qparams().scale for name, fq in fake_quantizers(converted) if fq.get_qparams().scale.numel() == 8]
    assert len(scales) == 1
    expected = model.w.detach().t().abs().amax(dim=1) / 127  # rows of w.t() = columns of w
    assert torch.equal(scales[0], expected)
    assert scales[0][[0, 7]].tolist() == torch.tensor([1.01 / 127, 20.0 / 127]).tolist()


class _AttentionPool(nn.Module):
    """A learned probe query of length 1 attends over the tokens (SigLIP's MAP head)."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, dim))
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.fc = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.attn(self.probe.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0]
        return self.fc(pooled[:, 0])


def test_attention_pooling_head_quantizes_each_packed_projection_slice_per_row(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _AttentionPool().eval()
    x = torch.randn(2, 6, 128)
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), (x,))
    calibrate(prepared, [x, torch.randn(2, 6, 128)], progress=False)
    converted = convert(prepared)
    packed = model.attn.in_proj_weight.detach()
    scales = sorted((fq.get_qparams().scale for name, fq in fake_quantizers(converted) if "in_proj" in name),
                    key=len)
    assert [len(s) for s in scales] == [128, 256]  # w_q rows, then w_k and w_v rows
    assert torch.equal(torch.cat(scales), packed.abs().amax(dim=1) / 127)  # the whole weight's per-row scales
    with torch.no_grad():
        ref, out = model(x), converted(x)
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    print(f"attention-pooling head: {sqnr:.1f} dB against float")
    assert sqnr > 25.0
    path = tmp_path / "map_head.onnx"
    export_onnx(converted, (x,), path)
    report = verify_onnx(converted, path, [(x,)])
    assert report.ok, report
