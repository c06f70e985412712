"""prepare and export_onnx trace with Python's cyclic garbage collector paused, then restore it (gc_paused.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.gc_paused import gc_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_the_block_runs_without_the_collector_and_the_caller_s_setting_comes_back_after_an_error_too(enabled: bool):
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError, match="inside"), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_export_onnx_traces_with_the_collector_paused_and_leaves_it_enabled(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), x[0])
    co.calibrate(prepared, x, progress=False)
    converted = co.convert(prepared)
    seen: list[bool] = []
    trace = torch.onnx.export

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", spy)
    assert gc.isenabled()
    co.export_onnx(converted, x[0], tmp_path / "m.onnx")
    assert seen == [False] and gc.isenabled()


def test_prepare_captures_with_the_collector_paused_and_leaves_it_enabled(monkeypatch):
    seen: list[bool] = []
    capture = torch.export.export

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return capture(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spy)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    co.prepare(model, co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 8),), capture="export")
    assert seen == [False] and gc.isenabled()
