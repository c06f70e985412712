"""The order to judge quantizers in: each after the quantizers it reads in onnxruntime's graph, not the file's.

Rules 2 and 3 of :mod:`coreai_opt.onnx.verify.quantizer_codes` let a quantizer inherit what the quantizers it reads
got wrong, so those must be judged first. The exported file's order usually is that order, but onnxruntime's
optimized graph can compute a later quantizer's tensor first: its NHWC layout transformer runs a ``QLinearConv``
in NHWC and writes the *permuted* copy a later quantizer holds (timm rdnet_tiny: a depthwise conv, then the
``permute`` to channels-last before its LayerNorm), and the earlier quantizer's NCHW tensor becomes a ``Transpose``
of it. Judged in file order, that quantizer read a quantizer not judged yet and inherited nothing: 1.8 % of its codes
differed where 1.0 % were allowed, though every one of them was the later quantizer's.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

__all__ = ["reading_order"]


def reading_order(tensors: Sequence[str], reads: Mapping[str, set[str]]) -> list[int]:
    """Indices of ``tensors``, each after the indices of the tensors it reads; otherwise in the given order.

    Args:
        tensors: The quantizers' tensors, in the file's order.
        reads: Per tensor, the quantizer tensors it is computed from in onnxruntime's graph.

    Returns:
        A permutation of ``range(len(tensors))``; on a cycle (never expected) the rest in the given order.
    """
    index = {tensor: i for i, tensor in enumerate(tensors)}
    waiting = {i: {index[r] for r in reads.get(t, ()) if r in index and index[r] != i} for i, t in enumerate(tensors)}
    readers: dict[int, list[int]] = {}
    for i, sources in waiting.items():
        for source in sources:
            readers.setdefault(source, []).append(i)
    ready = [i for i, sources in waiting.items() if not sources]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for reader in readers.get(i, ()):
            waiting[reader].discard(i)
            if not waiting[reader]:
                heapq.heappush(ready, reader)
    done = set(order)
    return order + [i for i in range(len(tensors)) if i not in done]
