"""torch's exporter leaves the bounds of a second Clip on the same input unregistered; the export repairs it."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.export.exporter_repairs import register_dangling_constants


class _ClampedLinear(nn.Module):
    """timm's Gemma 4 ``ClippableLinear``: the input clamped by buffers of its own, then a linear."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("low", torch.tensor(low))
        self.register_buffer("high", torch.tensor(high))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.clamp(x, self.low, self.high))


class _ThreeClampsOfOneInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = _ClampedLinear(-1.0, 1.0), _ClampedLinear(-0.5, 2.0), _ClampedLinear(-2.0, 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        return self.q(x) + self.k(x) * self.v(x)


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _torch_export(model: nn.Module) -> torch.onnx.ONNXProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(model, (_inputs(0),), dynamo=True, verbose=False)


def test_torch_export_reads_bounds_it_never_registered():
    """The premise: without the repair torch's file is invalid (so the repair is not moot)."""
    with pytest.raises(onnx.checker.ValidationError, match="_min_1"):
        onnx.checker.check_model(_torch_export(_ThreeClampsOfOneInput()).model_proto, full_check=True)


def test_registering_the_dangling_bounds_gives_a_valid_file_that_computes_the_model_exactly():
    model = _ThreeClampsOfOneInput().eval()
    program = _torch_export(model)
    assert sorted(register_dangling_constants(program.model)) == ["mul_max_1", "mul_max_2", "mul_min_1", "mul_min_2"]
    proto = program.model_proto
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = _inputs(3)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=0, atol=1e-6)
    assert register_dangling_constants(program.model) == []  # well formed now: nothing left to register


def test_a_quantized_model_with_three_clamps_of_one_input_exports_and_verifies(tmp_path):
    model = _ThreeClampsOfOneInput().eval()
    calibration = [(_inputs(seed),) for seed in range(4)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), calibration[0])
    co.calibrate(prepared, calibration, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, calibration[0], tmp_path / "clamps.onnx")
    onnx.checker.check_model(str(path), full_check=True)
    report = co.verify_onnx(converted, path, [(_inputs(9),)])
    assert report.ok, report
