"""Hand-built converted models for the ONNX tests: FakeQuantize modules placed by hand, calibrated, frozen.

These do not need the graph pass: each module wires FakeQuantize instances around a tensor, a weight or a
conv/linear, calibrates them on one batch and puts them in export mode, exactly what ``convert`` does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.spec.granularity import Granularity, PerBlock, PerChannel, PerTensor
from coreai_opt.quantization.spec.spec import QuantizationSpec

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
INTEGER = ("int8", "uint8", "int16", "uint16", "int4", "uint4")
ALL_DTYPES = INTEGER + FLOAT8


def make_fq(dtype: str, granularity: Granularity, qscheme: str | None = None, name: str = "") -> FakeQuantize:
    """A FakeQuantize with a min/max static calculator; unsigned dtypes default to asymmetric."""
    if qscheme is None:
        qscheme = "asymmetric" if dtype.startswith("u") else "symmetric"
    fq = FakeQuantize(QuantizationSpec(dtype=dtype, granularity=granularity, qscheme=qscheme))
    if name:
        fq.set_name(name)
    return fq


def freeze(model: nn.Module, *calibration_inputs: torch.Tensor) -> nn.Module:
    """Calibrate every FakeQuantize on one forward (observer on, fake-quant off), then export mode; eval()."""
    quantizers = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    for fq in quantizers:
        fq.enable_observer(True)
        fq.enable_fake_quant(False)
    with torch.no_grad():
        model(*calibration_inputs)
    for fq in quantizers:
        fq.set_export_mode(True)
    return model.eval()


def power_of_two_scales(model: nn.Module) -> nn.Module:
    """Round every frozen scale to a power of two, so float matmul/conv sums of dequantized values are exact."""
    for fq in (m for m in model.modules() if isinstance(m, FakeQuantize)):
        scale = fq.calculator.scale
        scale.copy_(torch.exp2(torch.round(torch.log2(scale))))
    return model


class ActivationAndWeight(nn.Module):
    """Output 0: ``fq_act(x)``; output 1: ``x + fq_w(weight)`` (exact Add of the folded, dequantized weight).

    ``x`` has shape ``(N, 8, 64)``; the weight ``(8, 64)``. Per-channel uses axis 1 for the activation and
    axis 0 for the weight; per-block blocks the last axis for both.
    """

    def __init__(self, dtype: str, granularity: str, qscheme: str | None = None, block_size: int = 16) -> None:
        super().__init__()
        act_g, w_g = {
            "per_tensor": (PerTensor(), PerTensor()),
            "per_channel": (PerChannel(1), PerChannel(0)),
            "per_block": (PerBlock(2, block_size), PerBlock(1, block_size)),
        }[granularity]
        self.weight = nn.Parameter(torch.randn(8, 64) * 0.3)
        self.act = make_fq(dtype, act_g, qscheme, "x")
        self.wq = make_fq(dtype, w_g, qscheme, "weight")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.act(x), x + self.wq(self.weight)


class QuantConv(nn.Module):
    """``act_out(conv(act_in(x), w_q(weight), bias_q(bias)))`` with an optional relu: the QDQ conv pattern."""

    def __init__(self, weight_dtype: str = "int8", act_dtype: str = "uint8",
                 weight_granularity: Granularity | None = None, int32_bias: bool = True, in_channels: int = 4,
                 out_channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.act_in = make_fq(act_dtype, PerTensor(), name="conv.input")
        self.w_q = make_fq(weight_dtype, weight_granularity or PerChannel(0), "symmetric", "conv.weight")
        self.bias_q = BiasFakeQuantize() if int32_bias else None
        self.act_out = make_fq(act_dtype, PerTensor(), name="conv.output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.act_in(x)
        w = self.w_q(self.conv.weight)
        b = self.conv.bias
        if self.bias_q is not None and self.act_in.export_mode:
            b = self.bias_q(b, self.act_in.calculator.scale, self.w_q.calculator.scale)
        return self.act_out(nn.functional.conv2d(xq, w, b, padding=1))


class QuantMLP(nn.Module):
    """Two quantized linears (uint8 activations, int8 per-channel weights) and a quantized classifier output."""

    def __init__(self, features: int = 64, hidden: int = 32, classes: int = 10, weight_dtype: str = "int8",
                 weight_granularity: Granularity | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(features, hidden), nn.Linear(hidden, classes)
        g = weight_granularity or PerChannel(0)
        self.q_in = make_fq("uint8", PerTensor(), name="input")
        self.w1 = make_fq(weight_dtype, g, "symmetric", "fc1.weight")
        self.w2 = make_fq(weight_dtype, g, "symmetric", "fc2.weight")
        self.q_hidden = make_fq("uint8", PerTensor(), name="fc1.output")
        self.q_out = make_fq("uint8", PerTensor(), name="fc2.output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_hidden(torch.relu(nn.functional.linear(self.q_in(x), self.w1(self.fc1.weight), self.fc1.bias)))
        return self.q_out(nn.functional.linear(h, self.w2(self.fc2.weight), self.fc2.bias))


def block_fold_ratio(num_params: int, block_size: int, bits: int) -> float:
    """Ideal size of a blocked weight (values + float32 scales) relative to fp32."""
    return (num_params * bits / 8 + 4 * math.ceil(num_params / block_size)) / (4 * num_params)
