"""Write an ONNX model atomically, as one file or with its tensors in ``<file name>.data`` beside it.

Path rules (used by :func:`coreai_opt.onnx.export_onnx`):

* The parent directory must exist; it is not created (a typo in a path should not litter the disk). A missing
  directory raises ``FileNotFoundError`` naming it.
* Models whose tensors total at most :data:`SINGLE_FILE_LIMIT_BYTES` are one self-contained file.
* Larger models (protobuf cannot serialise 2 GB) keep their graph in ``path`` and every tensor of at least
  :data:`EXTERNAL_TENSOR_MIN_BYTES` in ``path.name + ".data"`` in the same directory (e.g. ``model.onnx`` +
  ``model.onnx.data``), referenced by that *relative* name, so the pair can be moved together. Offsets are
  aligned to :data:`EXTERNAL_DATA_ALIGNMENT` bytes.
* Everything is first written to temporary files in the target directory and then moved into place with
  ``os.replace``: an interrupted or failed write never leaves a truncated model, and a model already at
  ``path`` stays intact until the new one is complete. The data file is replaced before the graph file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
from onnx import numpy_helper

__all__ = [
    "SINGLE_FILE_LIMIT_BYTES",
    "EXTERNAL_TENSOR_MIN_BYTES",
    "EXTERNAL_DATA_ALIGNMENT",
    "check_output_path",
    "external_data_path",
    "save_model_atomically",
]

#: Above this many bytes of tensor data the tensors go to ``<name>.data`` (protobuf's hard limit is 2 GiB; the
#: margin leaves room for the graph itself).
SINGLE_FILE_LIMIT_BYTES = 2_000_000_000
#: Tensors smaller than this stay inside the graph file even when external data is used.
EXTERNAL_TENSOR_MIN_BYTES = 1024
#: Byte alignment of each tensor inside the external data file.
EXTERNAL_DATA_ALIGNMENT = 64


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """Validate an output path and return it as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``path`` is not a str or path-like.
        FileNotFoundError: The parent directory does not exist.
        IsADirectoryError: ``path`` is an existing directory.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"ONNX output path {path} is a directory; pass a file path such as {path / 'model.onnx'}"
        )
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"directory {path.parent} does not exist; create it first (export_onnx does not create directories)"
        )
    return path


def external_data_path(path: Path) -> Path:
    """Return the external data file used for ``path`` (``model.onnx`` -> ``model.onnx.data``)."""
    return path.with_name(path.name + ".data")


def _tensor_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) if t.HasField("raw_data") else t.ByteSize() for t in model.graph.initializer)


def _externalize(model: onnx.ModelProto, location: str) -> bytes:
    """Move large initializers out of ``model`` (in place); return the bytes of the data file."""
    chunks: list[bytes] = []
    offset = 0
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data"):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
        if len(tensor.raw_data) < EXTERNAL_TENSOR_MIN_BYTES:
            continue
        padding = -offset % EXTERNAL_DATA_ALIGNMENT
        chunks.append(b"\0" * padding)
        offset += padding
        data = tensor.raw_data
        chunks.append(data)
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.ClearField("raw_data")
        offset += len(data)
    return b"".join(chunks)


def _write_temp(directory: Path, prefix: str, data: bytes) -> Path:
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def _set_location(model: onnx.ModelProto, location: str) -> None:
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location


def save_model_atomically(model: onnx.ModelProto, path: Path) -> bool:
    """Check and write ``model`` to ``path`` following the module's path rules (``model`` may be modified).

    The single-file model is checked in memory; a model with external data is checked from its temporary files
    (the checker then reads the tensors from disk, which also works above 2 GB).

    Args:
        model: The model; its large initializers are moved to external data in place when needed.
        path: Destination (validate it with :func:`check_output_path` first).

    Returns:
        True when the tensors were written to :func:`external_data_path` ``(path)``.

    Raises:
        onnx.checker.ValidationError: The model is invalid (nothing is written).
    """
    external = _tensor_bytes(model) > SINGLE_FILE_LIMIT_BYTES
    temps: list[Path] = []
    try:
        if external:
            temp_data = _write_temp(path.parent, f".{path.name}.data.", _externalize(model, ""))
            temps.append(temp_data)
            _set_location(model, temp_data.name)
            temp_model = _write_temp(path.parent, f".{path.name}.", model.SerializeToString(deterministic=True))
            temps.append(temp_model)
            onnx.checker.check_model(str(temp_model))
            _set_location(model, external_data_path(path).name)
            temp_model.write_bytes(model.SerializeToString(deterministic=True))
            os.replace(temp_data, external_data_path(path))
        else:
            onnx.checker.check_model(model)
            temp_model = _write_temp(path.parent, f".{path.name}.", model.SerializeToString(deterministic=True))
            temps.append(temp_model)
        os.replace(temp_model, path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
    return external
