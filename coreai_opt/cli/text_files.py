"""Write report files atomically, without following a symlink planted at the destination.

``Path.write_text`` opens the destination and follows a symlink there, so a link planted at
``model.report.txt`` would make the CLI overwrite the link's target. :func:`write_text_atomically` instead writes
a new temporary file in the destination's directory (``O_EXCL``: never an existing file or link), then renames it
over the destination with ``os.replace``, which replaces the link itself and leaves its target alone. A failed
write leaves the old file intact. The file gets the usual ``0o666 & ~umask`` permissions.

(``coreai_opt.onnx.save`` is getting a shared writer of this kind; this one serves the CLI until then.)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomically"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomically(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and ``os.replace``.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: The directory is not writable.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f"{path} is a directory; pass a file path")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path
