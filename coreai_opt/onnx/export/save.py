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
* Permissions are those ``open(path, "w")`` gives: a new file gets ``0o666 & ~umask``, an existing regular file
  keeps its mode. A symlink planted at ``path`` is replaced by the new file; nothing is written through it.
* Temporary names are ``.<target name, shortened>.<random>.tmp``, never longer than the directory's name limit,
  so any valid target name works (a 255-byte one included).

:func:`write_bytes_atomically` / :func:`write_text_atomically` apply the same rules to any file (reports, configs).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import numpy_helper

from coreai_opt.error_boundary import public_api
from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.onnx.export.stream_model import write_model

__all__ = [
    "SINGLE_FILE_LIMIT_BYTES",
    "EXTERNAL_TENSOR_MIN_BYTES",
    "EXTERNAL_DATA_ALIGNMENT",
    "check_output_path",
    "external_data_path",
    "save_model_atomically",
    "write_bytes_atomically",
    "write_text_atomically",
]

#: Above this many bytes of tensor data the tensors go to ``<name>.data`` (protobuf's hard limit is 2 GiB; the
#: margin leaves room for the graph itself).
SINGLE_FILE_LIMIT_BYTES = 2_000_000_000
#: Tensors smaller than this stay inside the graph file even when external data is used.
EXTERNAL_TENSOR_MIN_BYTES = 1024
#: Byte alignment of each tensor inside the external data file.
EXTERNAL_DATA_ALIGNMENT = 64
#: File name limit (bytes) when the file system does not report one.
_DEFAULT_NAME_MAX = 255
_TEMP_ATTEMPTS = 100


def check_output_path(path: str | os.PathLike[str], *, caller: str = "export_onnx") -> Path:
    """Validate an output path and return it as a :class:`~pathlib.Path` (``caller`` names the writer in messages).

    Raises:
        TypeError: ``path`` is not a str or path-like.
        FileNotFoundError: The parent directory does not exist.
        IsADirectoryError: ``path`` is an existing directory.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        what, example = ("ONNX", "model.onnx") if caller == "export_onnx" else (caller, "report.txt")
        raise IsADirectoryError(f"{what} output path {path} is a directory; pass a file path such as {path / example}")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"directory {path.parent} does not exist; create it first ({caller} does not create directories)"
        )
    return path


def external_data_path(path: Path) -> Path:
    """Return the external data file used for ``path`` (``model.onnx`` -> ``model.onnx.data``)."""
    return path.with_name(path.name + ".data")


def _tensor_bytes(model: onnx.ModelProto, detached: dict[str, onnx.TensorProto]) -> int:
    tensors = [detached.get(t.name, t) for t in model.graph.initializer]
    return sum(len(t.raw_data) if t.HasField("raw_data") else t.ByteSize() for t in tensors)


def _externalize(model: onnx.ModelProto, location: str, out: BinaryIO, detached: dict[str, onnx.TensorProto]) -> None:
    """Move large initializers out of ``model`` (in place), writing the data file to ``out`` one tensor at a time.

    A detached tensor (consumed from ``detached``) is written from its own message and only its description (name,
    type, dims, external-data record) is copied into its stub.
    """
    offset = 0
    for stub in model.graph.initializer:
        tensor = detached.pop(stub.name, stub)
        if not tensor.HasField("raw_data"):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
        if len(tensor.raw_data) < EXTERNAL_TENSOR_MIN_BYTES:
            if tensor is not stub:
                stub.CopyFrom(tensor)
            continue
        padding = -offset % EXTERNAL_DATA_ALIGNMENT
        out.write(b"\0" * padding)
        offset += padding
        data = tensor.raw_data
        out.write(data)
        if tensor is not stub:
            tensor.ClearField("raw_data")  # a standalone message: its data is freed now
            stub.CopyFrom(tensor)
        del stub.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
            entry = stub.external_data.add()
            entry.key, entry.value = key, value
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.ClearField("raw_data")
        offset += len(data)
        del data, tensor


def _name_max(directory: Path) -> int:
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return _DEFAULT_NAME_MAX


def _temp_name(target: Path) -> str:
    """``.<target name>.<random>.tmp``, the target name shortened so the whole name fits the name limit."""
    suffix = f".{secrets.token_hex(4)}.tmp"
    budget = _name_max(target.parent) - 1 - len(suffix)
    stem = os.fsencode(target.name)[: max(budget, 0)].decode("utf-8", errors="ignore")
    return f".{stem}{suffix}"


def _existing_mode(target: Path) -> int | None:
    """Permission bits of the regular file at ``target`` (not following a symlink), None when there is none."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None


def _create_temp(target: Path) -> tuple[int, Path]:
    """Create a new temporary file beside ``target``; mode ``0o666 & ~umask`` (as ``open``) or the target's."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TEMP_ATTEMPTS):
        temp = target.parent / _temp_name(target)
        try:
            fd = os.open(temp, flags, 0o666)  # the kernel applies the umask, exactly as for open(path, "w")
        except FileExistsError:
            continue
        mode = _existing_mode(target)
        if mode is not None and hasattr(os, "fchmod"):  # POSIX; Windows files have no such mode bits
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                temp.unlink(missing_ok=True)
                raise
        return fd, temp
    raise FileExistsError(f"could not create a temporary file beside {target} after {_TEMP_ATTEMPTS} attempts")


def _write_temp(target: Path, data: bytes | Callable[[BinaryIO], None]) -> Path:
    """Write ``data`` (bytes, or a writer called with the open file) to a fsynced temporary file beside ``target``.

    See :func:`_create_temp`; returns the temporary file's path.
    """
    fd, temp = _create_temp(target)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_atomically(target: Path, data: bytes) -> Path:
    temp = _write_temp(target, data)
    try:
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    _sync_directory(target.parent)
    return target


@public_api
def write_bytes_atomically(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> Path:
    """Write ``data`` to ``path`` so that ``path`` always holds either its old content or all of ``data``.

    Follows the module's rules: the directory must exist, permissions as ``open(path, "wb")`` gives them
    (an existing file keeps its mode), a symlink at ``path`` is replaced (never written through), temporary
    files beside ``path`` are removed on any failure (``KeyboardInterrupt`` included).

    Returns:
        ``Path(path)``.

    Raises:
        TypeError: ``path`` is not a path, or ``data`` not bytes-like.
        FileNotFoundError: The directory does not exist.
        IsADirectoryError: ``path`` is a directory.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}; use write_text_atomically for str")
    return _replace_atomically(check_output_path(path, caller="write_bytes_atomically"), bytes(data))


@public_api
def write_text_atomically(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (``encoding``, default UTF-8); see :func:`write_bytes_atomically`.

    Returns:
        ``Path(path)``.

    Raises:
        TypeError: ``path`` is not a path, or ``text`` not a str.
        FileNotFoundError: The directory does not exist.
        IsADirectoryError: ``path`` is a directory.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}; use write_bytes_atomically for bytes")
    target = check_output_path(path, caller="write_text_atomically")
    return _replace_atomically(target, text.encode(encoding))


def _set_location(model: onnx.ModelProto, location: str) -> None:
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location


def save_model_atomically(model: onnx.ModelProto, path: Path,
                          detached: dict[str, onnx.TensorProto] | None = None) -> bool:
    """Check and write ``model`` to ``path`` following the module's path rules (``model`` may be modified).

    The model is checked from its temporary files before they are moved into place (so the serialised bytes are
    not held while the checker parses them; with external data the checker reads the tensors from disk, which also
    works above 2 GB).

    Args:
        model: The model; its large initializers are moved to external data in place when needed.
        detached: Initializers held outside ``model`` (``OnnxGraph.write_back(detached=True)``; the model has
            name-only stubs for them), written in their stubs' places and consumed (each freed once written).
        path: Destination (validate it with :func:`check_output_path` first).

    Returns:
        True when the tensors were written to :func:`external_data_path` ``(path)``.

    Raises:
        onnx.checker.ValidationError: The model is invalid (nothing is written).
        CoreaiOptValueError: External data is needed but ``path.name + ".data"`` exceeds the name limit.
    """
    detached = {} if detached is None else detached
    external = _tensor_bytes(model, detached) > SINGLE_FILE_LIMIT_BYTES
    data_path = external_data_path(path)
    if external and len(os.fsencode(data_path.name)) > _name_max(path.parent):
        raise CoreaiOptValueError(
            f"the model needs an external data file named {data_path.name!r}, which is longer than the file system's "
            f"name limit of {_name_max(path.parent)} bytes; choose a shorter file name than {path.name!r}"
        )
    temps: list[Path] = []
    try:
        if external:
            temp_data = _write_temp(data_path, lambda out: _externalize(model, "", out, detached))  # streamed
            temps.append(temp_data)
            _set_location(model, temp_data.name)
            temp_model = _write_temp(path, lambda out: write_model(model, out))
            temps.append(temp_model)
            onnx.checker.check_model(str(temp_model))
            _set_location(model, data_path.name)
            temp_model.write_bytes(model.SerializeToString(deterministic=True))
            os.replace(temp_data, data_path)
        else:  # streamed (one initializer's encoding at a time), then checked from the file
            temp_model = _write_temp(path, lambda out: write_model(model, out, detached))
            temps.append(temp_model)
            onnx.checker.check_model(str(temp_model))
        os.replace(temp_model, path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
    _sync_directory(path.parent)
    return external
