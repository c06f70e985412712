"""No data loss: an export that fails at any point (exporter, checker, a write cut off midway, a rename, Ctrl-C)
never leaves a truncated or temporary file behind and never damages a file already at the target path."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as onnx_export
import coreai_opt.onnx.export.save as onnx_save

from .conftest import Pipeline, ort_run

OLD = b"previous model, must survive"
_REAL_FDOPEN = os.fdopen


def _matmul_model(value: float, size: int = 64) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((size, size), value, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


class _CutOffFile(io.RawIOBase):
    """A file object that writes the first half of what it is given, then fails like a full disk."""

    def __init__(self, fd: int) -> None:
        self._file = _REAL_FDOPEN(fd, "wb")

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._file.write(bytes(data[: len(data) // 2]))
        self._file.flush()
        raise OSError(28, "No space left on device")

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        super().close()


def _cut_off_fdopen() -> Callable:
    def fdopen(fd: int, mode: str = "r", *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return _CutOffFile(fd) if "w" in mode else _REAL_FDOPEN(fd, mode, *args, **kwargs)
    return fdopen


def _failing_nth_replace(n: int) -> Callable:
    real, calls = os.replace, []

    def replace(src, dst) -> None:  # noqa: ANN001
        calls.append(dst)
        if len(calls) == n:
            raise OSError("simulated crash during rename")
        real(src, dst)
    return replace


@pytest.fixture(params=["absent", "existing"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    if request.param == "existing":
        path.write_bytes(OLD)
    return path


def _assert_untouched(target: Path, existed: bool) -> None:
    if existed:
        assert target.read_bytes() == OLD
    else:
        assert not target.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ([target.name] if existed else []), "no temporaries left"


@pytest.mark.parametrize("external", [False, True], ids=["single_file", "external_data"])
def test_write_cut_off_midway_leaves_no_partial_file(target: Path, monkeypatch: pytest.MonkeyPatch,
                                                     external: bool) -> None:
    existed = target.exists()
    if external:
        monkeypatch.setattr(onnx_save, "SINGLE_FILE_LIMIT_BYTES", 100)
    monkeypatch.setattr(onnx_save.os, "fdopen", _cut_off_fdopen())
    with pytest.raises(OSError, match="No space left on device"):
        onnx_save.save_model_atomically(_matmul_model(1.0), target)
    _assert_untouched(target, existed)


def test_failed_rename_leaves_no_partial_file(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    existed = target.exists()
    monkeypatch.setattr(onnx_save.os, "replace", _failing_nth_replace(1))
    with pytest.raises(OSError, match="simulated crash during rename"):
        onnx_save.save_model_atomically(_matmul_model(1.0), target)
    _assert_untouched(target, existed)


def test_interrupt_during_write_leaves_no_partial_file(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    existed = target.exists()

    def interrupted_fsync(fd: int) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(onnx_save.os, "fsync", interrupted_fsync)
    with pytest.raises(KeyboardInterrupt):
        onnx_save.save_model_atomically(_matmul_model(1.0), target)
    _assert_untouched(target, existed)


def test_invalid_model_is_refused_before_anything_is_written(target: Path) -> None:
    existed = target.exists()
    model = _matmul_model(1.0)
    model.graph.node[0].input[1] = "missing_weight"
    with pytest.raises(onnx.checker.ValidationError, match=r"missing_weight"):
        onnx_save.save_model_atomically(model, target)
    _assert_untouched(target, existed)


def test_external_data_pair_written_in_one_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_save, "SINGLE_FILE_LIMIT_BYTES", 100)
    path = tmp_path / "model.onnx"
    assert onnx_save.save_model_atomically(_matmul_model(2.0), path) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    out = ort_run(path, torch.ones(1, 64))
    assert float(out[0][0, 0]) == 128.0


def test_export_failing_midway_keeps_the_existing_file(cnn_pipeline: Pipeline, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through export_onnx: the exporter runs, then the write is cut off; the old file survives."""
    path = tmp_path / "model.onnx"
    path.write_bytes(cnn_pipeline.onnx_path.read_bytes())
    monkeypatch.setattr(onnx_save.os, "fdopen", _cut_off_fdopen())
    with pytest.raises(OSError, match="No space left on device"):
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), path)
    assert path.read_bytes() == cnn_pipeline.onnx_path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    np.testing.assert_array_equal(ort_run(path, cnn_pipeline.example)[0], ort_run(cnn_pipeline.onnx_path,
                                                                                  cnn_pipeline.example)[0])


def test_exporter_error_writes_nothing(cnn_pipeline: Pipeline, target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    existed = target.exists()

    def broken_exporter(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("exporter crashed")
    monkeypatch.setattr(onnx_export, "_export_proto", broken_exporter)
    with pytest.raises(RuntimeError, match="exporter crashed"):
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), target)
    _assert_untouched(target, existed)
