"""The error every capture step raises, and how it points at the user's source line."""

from __future__ import annotations

import os
import re

import torch
from torch.fx import Node

from coreai_opt.errors import CoreaiOptValueError

__all__ = ["CaptureError", "InplaceAliasError", "ShapeGuardError", "source_of"]

#: Frames in these directories are machinery, not the user's code (torch, and these passes' own tracer).
_MACHINERY = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n\s*(?P<code>[^\n]*)')


class CaptureError(CoreaiOptValueError):
    """The model cannot be captured as a graph computing what it computes; the message says why and the fix."""


class InplaceAliasError(CaptureError):
    """An in-place op writes through a view that is read again; ``capture="auto"`` then falls back to export."""


class ShapeGuardError(CaptureError):
    """The exported graph holds only one branch of a size-dependent ``forward`` (or fixes a dynamic size)."""


def source_of(node: Node) -> str:
    r"""``file:line: code`` of the innermost frame outside torch that created ``node`` ("" without a stack trace).

    Example:
        >>> import torch
        >>> graph = torch.fx.Graph()
        >>> node = graph.placeholder("x")
        >>> node.stack_trace = 'File "m.py", line 3, in forward\n    y = x.add_(1)\n'
        >>> source_of(node)
        'm.py:3: y = x.add_(1)'
    """
    frames = [f for f in _FRAME.finditer(node.stack_trace or "") if not f["file"].startswith(_MACHINERY)]
    if not frames:
        return ""
    last = frames[-1]
    return f"{last['file']}:{last['line']}: {last['code'].strip()}"
