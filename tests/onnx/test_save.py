from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from coreai_opt.onnx.export import save
from coreai_opt.onnx.export.save import check_output_path, external_data_path, save_model_atomically
from tests.onnx.onnx_graphs import conv_qdq_model, run

X = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


def test_save_model_atomically_writes_one_file_below_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    assert save_model_atomically(conv_qdq_model(), path) is False
    assert _leftovers(tmp_path, {"m.onnx"}) == []
    np.testing.assert_array_equal(run(onnx.load(str(path)), {"x": X})[0], run(conv_qdq_model(), {"x": X})[0])


def test_save_model_atomically_uses_relative_external_data_above_the_limit(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save, "SINGLE_FILE_LIMIT_BYTES", 512)
    monkeypatch.setattr(save, "EXTERNAL_TENSOR_MIN_BYTES", 64)
    path = tmp_path / "m.onnx"
    assert save_model_atomically(conv_qdq_model(), path) is True
    assert external_data_path(path) == tmp_path / "m.onnx.data"
    assert _leftovers(tmp_path, {"m.onnx", "m.onnx.data"}) == []
    proto = onnx.load(str(path), load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert [t.name for t in external] == ["conv.weight"]  # 864 bytes; the 32-byte bias stays inline
    assert {e.key: e.value for e in external[0].external_data}["location"] == "m.onnx.data"
    assert (tmp_path / "m.onnx.data").stat().st_size == 8 * 3 * 3 * 3 * 4

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(path, moved / "m.onnx")
    shutil.move(tmp_path / "m.onnx.data", moved / "m.onnx.data")
    import onnxruntime as ort

    session = ort.InferenceSession(str(moved / "m.onnx"), providers=["CPUExecutionProvider"])
    expected = run(conv_qdq_model(), {"x": X}, optimize=True)[0]
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], expected)


def test_save_model_atomically_keeps_existing_file_when_the_write_fails(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous model")

    def interrupted(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(save.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_model_atomically(conv_qdq_model(), path)
    assert path.read_bytes() == b"previous model"
    assert _leftovers(tmp_path, {"m.onnx"}) == []  # the temporary file was removed


def test_save_model_atomically_writes_nothing_for_an_invalid_model(tmp_path: Path) -> None:
    model = conv_qdq_model()
    model.graph.node[0].input[0] = "undefined_tensor"
    path = tmp_path / "m.onnx"
    with pytest.raises(onnx.checker.ValidationError):
        save_model_atomically(model, path)
    assert list(tmp_path.iterdir()) == []


def test_check_output_path_names_the_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"directory {tmp_path / 'nope'} does not exist; create it"):
        check_output_path(tmp_path / "nope" / "m.onnx")
    assert not (tmp_path / "nope").exists()


def test_check_output_path_rejects_a_directory_and_non_paths(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory"):
        check_output_path(tmp_path)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        check_output_path(42)  # type: ignore[arg-type]
