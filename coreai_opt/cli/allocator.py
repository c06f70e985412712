"""The CLI process's allocator setting: buffers of 4 MiB and more come from the system and go back to it when freed.

glibc serves a request below its *mmap threshold* from its heap, and starts that threshold at 128 KiB but raises it
to the size of each large block freed (up to 32 MiB). A quantization run frees many weight-sized blocks (a layer's
Hessian, a weight's integers, a dequantized copy for the export), so the threshold climbs, later weight-sized
buffers land on the heap, and what is freed there stays in the process wherever a live block sits above it. On a
1.1 B-parameter decoder (22 layers at TinyLlama's width, w4 GPTQ) that kept 2.7 GB after calibrate and 3.5 GB
after the export that ``malloc_trim`` could hand back, and it raised the peaks by as much.

:func:`return_large_buffers_to_the_system` fixes the threshold at :data:`MMAP_THRESHOLD_BYTES` with
``mallopt(M_MMAP_THRESHOLD, ...)`` (which also stops the dynamic adjustment): a weight-sized buffer is mapped on
its own and unmapped when freed. ``coreai-opt`` owns its process, so it sets this at start; a library imported
into someone else's process does not change their allocator (set ``MALLOC_MMAP_THRESHOLD_=4194304`` in the
environment for the same effect in a Python program). A user's own ``MALLOC_MMAP_THRESHOLD_`` is respected.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD_BYTES", "return_large_buffers_to_the_system"]

#: Requests of at least this many bytes are mapped on their own (and returned to the system when freed).
MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_buffers_to_the_system() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (module docstring).

    Returns:
        True when the setting was applied; False on other platforms or C libraries, or when the environment sets
        ``MALLOC_MMAP_THRESHOLD_`` already.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl or another C library: leave its allocator alone
        return False
    mallopt = getattr(libc, "mallopt", None)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
