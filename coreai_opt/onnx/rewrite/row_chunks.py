"""Row chunks of a weight and the matching slices of its Q/DQ parameters, for elementwise work in bounded memory.

Quantization, dequantization and clamps are elementwise once their parameters are broadcast, so evaluating them
on rows ``start:stop`` of the weight with the parameters sliced to the same rows gives exactly the rows of the
whole-tensor result, while the float / float64 temporaries stay a few chunks large.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CHUNK_BYTES", "broadcast_rows", "qparam_rows", "row_ranges"]

#: Bytes of weight rows (at float32 size) handled at a time; the temporaries are a few times this.
CHUNK_BYTES = 4 << 20


def row_ranges(shape: tuple[int, ...], axis: int, block_size: int,
               chunk_bytes: int | None = None) -> list[slice]:
    """Row slices covering a weight of ``shape`` (rank >= 1), about ``chunk_bytes`` of float32 rows each.

    ``chunk_bytes`` defaults to :data:`CHUNK_BYTES` (read at call time).

    With blocked parameters along axis 0 (``block_size > 0``) every slice starts on a block boundary.
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = shape[0]
    row_bytes = 4 * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, chunk_bytes // max(1, row_bytes))
    if block_size > 0 and axis == 0:
        step = max(block_size, step - step % block_size)
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def qparam_rows(param: np.ndarray | None, axis: int, block_size: int, rows: slice) -> np.ndarray | None:
    """The part of a scale / zero point (ONNX Q/DQ layout, ``axis`` non-negative) that applies to ``rows``."""
    if param is None or (param.size == 1 and param.ndim <= 1):
        return param  # per tensor
    if block_size > 0:  # blocked qparams have the weight's rank; along the block axis one entry per block
        if axis != 0:
            return param[rows]
        return param[rows.start // block_size: -(-rows.stop // block_size)]
    return param[rows] if axis == 0 else param  # per channel: only a channel axis 0 runs along the rows


def broadcast_rows(array: np.ndarray | None, rank: int, rows: slice) -> np.ndarray | None:
    """The part of ``array`` (numpy-broadcast against a weight of rank ``rank`` >= its own) for weight ``rows``."""
    if array is None or array.ndim < rank or array.shape[0] == 1:
        return array  # constant along the weight's rows
    return array[rows]
