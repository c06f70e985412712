"""Files are written like ``open(path, "w")`` would write them, but atomically.

New files get ``0o666 & ~umask``, an overwritten file keeps its mode, any valid name (255 bytes) works, a symlink
planted at the destination is replaced (its target is never written), and failures leave nothing behind.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import coreai_opt as co
import coreai_opt.onnx.export.save as onnx_save
from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.onnx.export.save import save_model_atomically, write_bytes_atomically, write_text_atomically

from .conftest import Pipeline, ort_run


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    """Run with umask 022 (restored afterwards); tests that need another one set it themselves."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _small_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((64, 64), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
@pytest.mark.parametrize("writer", ["model", "text", "bytes"])
def test_new_files_get_the_mode_open_would_give(tmp_path: Path, mask: int, writer: str) -> None:
    reference, target = tmp_path / "reference", tmp_path / "target"
    previous = os.umask(mask)
    try:
        reference.write_text("x")  # open(path, "w")
        {"model": lambda: save_model_atomically(_small_model(), target),
         "text": lambda: write_text_atomically(target, "report"),
         "bytes": lambda: write_bytes_atomically(target, b"report")}[writer]()
    finally:
        os.umask(previous)
    assert _mode(target) == _mode(reference) == 0o666 & ~mask


@pytest.mark.parametrize("existing_mode", [0o644, 0o600, 0o640, 0o664])
def test_overwriting_keeps_the_existing_files_mode(tmp_path: Path, existing_mode: int, umask: None) -> None:
    """As ``open(path, "w")`` does (it truncates the existing file): the old mode survives, not 0600 or the umask."""
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    target.chmod(existing_mode)
    save_model_atomically(_small_model(), target)
    assert _mode(target) == existing_mode
    report = tmp_path / "report.txt"
    report.write_text("old")
    report.chmod(existing_mode)
    write_text_atomically(report, "new")
    assert _mode(report) == existing_mode and report.read_text() == "new"


def test_export_onnx_overwriting_a_0644_file_keeps_0644(cnn_pipeline: Pipeline, tmp_path: Path, umask: None) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    target.chmod(0o644)
    co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), target)
    assert _mode(target) == 0o644
    np.testing.assert_array_equal(ort_run(target, cnn_pipeline.example)[0],
                                  ort_run(cnn_pipeline.onnx_path, cnn_pipeline.example)[0])


@pytest.mark.parametrize("name", ["m" * 245 + ".onnx", "m" * 250 + ".onnx", "é" * 125 + ".onnx"],
                         ids=["250_chars", "255_chars", "255_bytes_utf8"])
def test_the_longest_valid_names_work_and_temporaries_fit_the_name_limit(tmp_path: Path, name: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(os.fsencode(name)) <= 255
    temp_names: list[str] = []
    real_replace = os.replace

    def recording_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        temp_names.append(Path(src).name)
        real_replace(src, dst)
    monkeypatch.setattr(onnx_save.os, "replace", recording_replace)
    target = tmp_path / name
    save_model_atomically(_small_model(), target)
    write_text_atomically(tmp_path / name.replace(".onnx", ".txt"), "ok")
    assert target.is_file() and (tmp_path / name.replace(".onnx", ".txt")).read_text() == "ok"
    assert temp_names and all(len(os.fsencode(n)) <= 255 for n in temp_names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, name.replace(".onnx", ".txt")])


def test_external_data_pair_keeps_its_layout_and_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       umask: None) -> None:
    monkeypatch.setattr(onnx_save, "SINGLE_FILE_LIMIT_BYTES", 100)
    path = tmp_path / "model.onnx"
    (tmp_path / "model.onnx.data").write_bytes(b"old data")
    (tmp_path / "model.onnx.data").chmod(0o640)
    assert save_model_atomically(_small_model(), path) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert _mode(path) == 0o644 and _mode(tmp_path / "model.onnx.data") == 0o640
    proto = onnx.load(str(path), load_external_data=False)
    assert {e.key: e.value for e in proto.graph.initializer[0].external_data}["location"] == "model.onnx.data"
    assert float(ort_run(path, torch.ones(1, 64))[0][0, 0]) == 32.0


def test_external_data_with_a_name_too_long_for_its_data_file_is_refused_before_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_save, "SINGLE_FILE_LIMIT_BYTES", 100)
    path = tmp_path / ("m" * 250 + ".onnx")
    with pytest.raises(CoreaiOptValueError, match=r"external data file named .* longer than the file system's name "
                                                  r"limit of 255 bytes; choose a shorter file name"):
        save_model_atomically(_small_model(), path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("writer", ["model", "text"])
def test_a_symlink_planted_at_the_destination_is_replaced_and_its_target_untouched(tmp_path: Path,
                                                                                  writer: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o600)
    link = tmp_path / "out"
    link.symlink_to(victim)
    if writer == "model":
        save_model_atomically(_small_model(), link)
    else:
        write_text_atomically(link, "report")
    assert victim.read_text() == "precious" and _mode(victim) == 0o600
    assert not link.is_symlink() and link.is_file()
    if writer == "text":
        assert link.read_text() == "report"
    else:
        assert onnx.load(str(link)).graph.node[0].op_type == "MatMul"


def test_a_dangling_symlink_is_replaced_without_creating_its_target(tmp_path: Path) -> None:
    link = tmp_path / "report.txt"
    link.symlink_to(tmp_path / "elsewhere" / "created-by-attacker.txt")
    write_bytes_atomically(link, b"data")
    assert not link.is_symlink() and link.read_bytes() == b"data"
    assert not (tmp_path / "elsewhere").exists()


def test_an_interrupted_write_keeps_the_old_content_and_leaves_no_temporary(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "report.txt"
    target.write_text("old")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(onnx_save.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomically(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.txt"]


def test_writer_arguments_are_checked_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="data must be bytes, got str; use write_text_atomically"):
        write_bytes_atomically(tmp_path / "a", "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text must be a str, got bytes; use write_bytes_atomically"):
        write_text_atomically(tmp_path / "a", b"bytes")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"does not exist; create it first \(write_text_atomically does not"):
        write_text_atomically(tmp_path / "missing" / "a.txt", "x")
    with pytest.raises(IsADirectoryError, match="write_text_atomically output path .* is a directory"):
        write_text_atomically(tmp_path, "x")
