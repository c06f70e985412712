"""One sweep model per forked child of a parent that imported the libraries once.

A fresh interpreter per model spent 8 s of CPU (torch 4.5 s, transformers / onnxruntime / onnxscript and timm
the rest, measured on this machine; 15-20 s of wall time under the sweep's load) before its first stage: over
the 389 catalog entries, about 50 CPU minutes of imports. The chunk's parent now imports them once
(:func:`preload`, before any tensor is computed, so no thread pool exists yet) and forks a child per model:
the child starts with every module loaded, its memory copy-on-write, and is still its own process, so a crash,
a hang or a leak costs one row, as before. Its stdout and stderr go to temporary files the parent reads.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PRELOADED", "ChildResult", "preload", "run_forked"]

#: Modules every sweep child imports; the parent imports them once (timm after torchvision's op schemas).
PRELOADED = ("torch", "torch.onnx", "torch.export", "transformers", "onnx", "onnxruntime",
             "onnxruntime.quantization", "onnxscript", "onnx_ir", "coreai_opt", "benchmarks.corpus.runner",
             "benchmarks.sweep.catalog")

#: Seconds between the parent's checks of a running child.
POLL = 0.1


@dataclass(frozen=True)
class ChildResult:
    """How a forked child ended: ``returncode`` as :mod:`subprocess` gives it (negative: killed by that signal;
    None: still running at the timeout, then killed), and what it wrote to stdout and stderr."""

    returncode: int | None
    stdout: str
    stderr: str


def preload() -> None:
    """Import :data:`PRELOADED` (and timm) in this process, so that forked children start with them loaded.

    Raises:
        RuntimeError: a thread besides the main one runs afterwards: forking it would copy a half-held lock.
    """
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    for module in (*PRELOADED, "timm"):
        importlib.import_module(module)
    if threading.active_count() > 1:
        raise RuntimeError(f"preload left {threading.active_count() - 1} Python thread(s) running; "
                           "fork only a single-threaded parent")


def run_forked(target: Callable[[], None], timeout: float) -> ChildResult:
    """Run ``target`` in a forked child, killing it after ``timeout`` seconds; its exit status and output.

    The child exits 0 when ``target`` returns and 1 when it raises (the traceback on its stderr); it never
    returns into the parent's code.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                # Python's streams too, wherever the parent had pointed them (pytest's capture, a redirect)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until os._exit
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                target()
                code = 0
            except BaseException:  # noqa: BLE001 - everything ends the child; the parent reads the traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        returncode = _wait(pid, timeout)
        out.seek(0)
        err.seek(0)
        return ChildResult(returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def _wait(pid: int, timeout: float) -> int | None:
    """Wait for child ``pid`` up to ``timeout`` seconds; its return code, or None after killing it at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(POLL)
