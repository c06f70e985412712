"""Whole prepared / converted models survive torch.save, pickle and deepcopy, for both captures.

Measured before the fix: ``torch.load(weights_only=False)`` raised ``TypeError: _LeafTracer.__init__() missing 2
required positional arguments`` (and pickling failed the same way); reloaded graphs had lost every node's metadata.
Only the public API is used to compare (outputs, ``summary``, ``export_onnx`` bytes), so the checks hold whatever
the graph metadata looks like inside.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co

from .conftest import cnn_batches, make_small_cnn


def _torch_save(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch.save": _torch_save,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
}


@pytest.fixture(scope="module", params=["fx", "export"])
def pipeline(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = cnn_batches()
    prepared = co.prepare(make_small_cnn(), co.QuantizerConfig.presets.w8a8(), (data[0],), capture=request.param)
    uncalibrated = copy.deepcopy(prepared)
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = tmp_path_factory.mktemp(request.param) / "original.onnx"
    co.export_onnx(converted, (data[0],), path)
    return {"capture": request.param, "data": data, "uncalibrated": uncalibrated, "prepared": prepared,
            "converted": converted, "onnx": path.read_bytes()}


@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
@pytest.mark.parametrize("which", ["prepared", "converted"])
def test_reloaded_model_gives_bit_identical_outputs_and_the_same_summary(pipeline: dict, which: str,
                                                                         trip: str) -> None:
    model = pipeline[which]
    loaded = ROUND_TRIPS[trip](model)
    with torch.no_grad():
        assert all(torch.equal(loaded(x), model(x)) for x in pipeline["data"])
    assert str(co.summary(loaded)) == str(co.summary(model))
    assert co.summary(loaded).capture == pipeline["capture"] and co.summary(loaded).converted == (which == "converted")


@pytest.mark.parametrize("trip", ["torch.save", "deepcopy"])  # pickle is torch.save's path (export costs seconds)
def test_reloaded_uncalibrated_model_calibrates_converts_and_exports_the_same_file(pipeline: dict, trip: str,
                                                                                   tmp_path: Path) -> None:
    loaded = ROUND_TRIPS[trip](pipeline["uncalibrated"])
    co.calibrate(loaded, pipeline["data"], progress=False)
    converted = co.convert(loaded)
    with torch.no_grad():
        assert all(torch.equal(converted(x), pipeline["converted"](x)) for x in pipeline["data"])
    co.export_onnx(converted, (pipeline["data"][0],), tmp_path / "reloaded.onnx")
    assert (tmp_path / "reloaded.onnx").read_bytes() == pipeline["onnx"]


def test_reloaded_converted_model_exports_the_same_file(pipeline: dict, tmp_path: Path) -> None:
    loaded = _torch_save(pipeline["converted"])
    co.export_onnx(loaded, (pipeline["data"][0],), tmp_path / "reloaded.onnx")
    assert (tmp_path / "reloaded.onnx").read_bytes() == pipeline["onnx"]


def test_a_qat_model_of_a_class_defined_in_a_function_saves_and_keeps_training(tmp_path: Path) -> None:
    class Local(nn.Module):  # not picklable by reference: the graph metadata drops its type, nothing else
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            y.relu_()
            return y

    torch.manual_seed(0)
    prepared = co.prepare(Local(), co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 4),), qat=True)
    torch.save(prepared, tmp_path / "qat.pt")
    loaded = torch.load(tmp_path / "qat.pt", weights_only=False)
    assert loaded.training
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), prepared(x))
    loaded(x).sum().backward()
    assert loaded.get_parameter("fc.weight").grad is not None
