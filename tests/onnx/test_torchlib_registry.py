"""export_onnx builds torch's torchlib translation table once per opset (onnx/export/torchlib_registry.py)."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.onnx._internal.exporter import _registration

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as export_onnx_module
from coreai_opt.onnx.export import torchlib_registry
from coreai_opt.onnx.export.torchlib_registry import torchlib_registry_reused
from coreai_opt.quantization.ops.quantize_dequantize_op import quantize_dequantize


def test_a_copy_per_call_custom_translations_stay_in_their_copy_and_the_method_is_restored():
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    with torchlib_registry_reused() as replaced:
        assert replaced
        first, second = (_registration.ONNXRegistry.from_torchlib(21) for _ in range(2))
        assert first is not second and first.functions is not second.functions
        assert first.functions.keys() == second.functions.keys() and len(first.functions) > 400
        target = quantize_dequantize._opoverload
        assert not first.is_registered(target)
        first.register_op(target, lambda x: x)
        assert first.is_registered(target) and not second.is_registered(target)
        assert not _registration.ONNXRegistry.from_torchlib(21).is_registered(target)
        assert second.opset_version == 21 and _registration.ONNXRegistry.from_torchlib(18).opset_version == 18
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original


def test_the_table_is_built_once_a_second_build_costs_under_a_tenth_of_the_first(monkeypatch):
    monkeypatch.setattr(torchlib_registry, "_BUILT", {})  # as in a new process (other tests of this one built it)
    with torchlib_registry_reused():
        start = time.perf_counter()
        _registration.ONNXRegistry.from_torchlib(20)
        built = time.perf_counter() - start
        start = time.perf_counter()
        _registration.ONNXRegistry.from_torchlib(20)
        reused = time.perf_counter() - start
    assert reused < built / 10, (built, reused)


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def test_the_file_is_byte_identical_with_a_table_built_for_it(tmp_path, monkeypatch):
    x = [(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    prepared = co.prepare(_Small().eval(), co.QuantizerConfig.presets.w8a8(), x[0])
    co.calibrate(prepared, x, progress=False)
    converted = co.convert(prepared)
    co.export_onnx(converted, x[0], tmp_path / "reused.onnx")
    co.export_onnx(converted, x[0], tmp_path / "reused_again.onnx")



    monkeypatch.setattr(export_onnx_module, "torchlib_registry_reused", nullcontext)
    co.export_onnx(converted, x[0], tmp_path / "built.onnx")
    built = (tmp_path / "built.onnx").read_bytes()
    assert (tmp_path / "reused.onnx").read_bytes() == built == (tmp_path / "reused_again.onnx").read_bytes()
