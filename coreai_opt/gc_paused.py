"""Python's cyclic garbage collector paused while torch traces a model.

torch's exporter (capture, decompositions, translation, optimizer) allocates hundreds of thousands of short-lived
Python objects (fx nodes, fake tensors, sympy expressions). Each allocation burst triggers a collection, and every
third-generation collection walks every tracked object of the process: with torch, transformers and a model loaded,
about 730k of them. Measured (one process, 5 interleaved rounds, quiet machine; benchmarks/export_cost/RESULTS.md):
``export_onnx`` paused / collecting 0.858 on hf-llama, 0.894 on hf-vit, 0.911 on timm-efficientnet-b0 (medians),
and the garbage it would have found is small (hf-llama: 257k objects, +35 MB RSS, released by the next collection
after the block). Reference counting still frees everything that is not in a
cycle, so tensors go as soon as they are unused.

:func:`gc_paused` disables the collector for a ``with`` block (``prepare``'s capture and graph passes,
``export_onnx``'s trace) and restores the caller's setting afterwards (a caller
that had disabled it keeps it disabled); torch's distributed checkpointing does the same around its state-dict
traversals. The collector is process-wide: other threads run without it for the duration of the block too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled; re-enable it after if it was enabled."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
