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


def _collector_states(monkeypatch, module: object, name: str) -> list[bool]:
    """Wrap ``module.name``; the returned list gets ``gc.isenabled()`` at each call."""
    seen: list[bool] = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_export_onnx_traces_with_the_collector_paused_and_leaves_it_enabled(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), x[0])
    co.calibrate(prepared, x, progress=False)
    converted = co.convert(prepared)
    seen = _collector_states(monkeypatch, torch.onnx, "export")
    assert gc.isenabled()
    co.export_onnx(converted, x[0], tmp_path / "m.onnx")
    assert seen == [False] and gc.isenabled()


def test_prepare_captures_with_the_collector_paused_and_leaves_it_enabled(monkeypatch):
    seen = _collector_states(monkeypatch, torch.export, "export")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    co.prepare(model, co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 8),), capture="export")
    assert seen == [False] and gc.isenabled()
