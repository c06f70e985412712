"""Shared models and fixtures of the reliability suites.

Exports cost 1-5 s each on the shared CI machine, so the calibrated / converted / exported small CNN is built once
per session and shared; tests that need to mutate a model copy it first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import fx, nn

import coreai_opt as co

# The machine has 2 shared cores: intra-op threads oversubscribe them and slow tiny convs down ~50x.
torch.set_num_threads(1)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, Conv-ReLU, Flatten, Linear: every pattern the PTQ presets quantize, tiny enough to export fast."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.relu2 = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.relu2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))))


def make_small_cnn(seed: int = 0) -> SmallCNN:
    """A SmallCNN with seeded weights and non-trivial BatchNorm statistics, in eval mode."""
    torch.manual_seed(seed)
    model = SmallCNN()
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-0.5, 0.5)
        model.bn1.running_var.uniform_(0.5, 2.0)
        model.bn1.weight.uniform_(0.5, 1.5)
        model.bn1.bias.uniform_(-0.2, 0.2)
    return model.eval()


def cnn_batches(count: int = 3, batch: int = 4, seed: int = 1) -> list[torch.Tensor]:
    """Seeded calibration batches of shape ``(batch, 3, 8, 8)``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 8, 8, generator=generator) for _ in range(count)]


@dataclass
class Pipeline:
    """One run of prepare -> calibrate -> convert (-> export) on the small CNN."""

    model: nn.Module
    example: torch.Tensor
    data: list[torch.Tensor]
    prepared: fx.GraphModule
    converted: fx.GraphModule
    onnx_path: Path | None = None


def run_pipeline(config: co.QuantizerConfig | None = None, onnx_path: Path | None = None, seed: int = 0) -> Pipeline:
    """prepare/calibrate/convert the seeded small CNN (and export it when ``onnx_path`` is given)."""
    model = make_small_cnn(seed)
    data = cnn_batches()
    example = data[0]
    prepared = co.prepare(model, config or co.QuantizerConfig.presets.w8a8(), (example,))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    if onnx_path is not None:
        co.export_onnx(converted, (example,), onnx_path)
    return Pipeline(model, example, data, prepared, converted, onnx_path)


@pytest.fixture(scope="session")
def cnn_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """The w8a8 small-CNN pipeline, exported once per session (do not mutate; copy.deepcopy first)."""
    return run_pipeline(onnx_path=tmp_path_factory.mktemp("cnn") / "cnn.onnx")


@pytest.fixture
def converted_copy(cnn_pipeline: Pipeline) -> fx.GraphModule:
    """A private copy of the session's converted model."""
    return copy.deepcopy(cnn_pipeline.converted)


#: onnxruntime (1.32) fuses ``DequantizeLinear(int weight) -> MatMul`` into ``MatMulNBits`` whose default accuracy
#: level 4 quantizes the *float* activation to int8 on the fly; level 1 computes the graph's float semantics exactly.
EXACT_MATMUL_NBITS = {"session.qdq_matmulnbits_accuracy_level": "1"}


def ort_run(path: Path | str, *inputs: torch.Tensor, config: dict[str, str] | None = None) -> list[np.ndarray]:
    """Run an ONNX file on the CPU provider with positional inputs (``config``: session config entries)."""
    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)}
    return session.run(None, feeds)


@pytest.fixture(scope="session")
def ort_runner() -> Callable[..., list[np.ndarray]]:
    """``ort_runner(path, *inputs) -> list of outputs``."""
    return ort_run
