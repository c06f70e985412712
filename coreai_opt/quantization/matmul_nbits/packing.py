"""Pack a quantized weight into the inputs of onnxruntime's ``MatMulNBits`` (``com.microsoft``).

``MatMulNBits(A, B, scales, zero_points)`` computes ``A @ W.T`` with ``W [N, K]`` stored per row ``n`` in
``ceil(K / block_size)`` blocks of ``block_size`` elements along ``K`` (attributes ``K``, ``N``, ``bits``,
``block_size``). Its storage is unsigned (onnxruntime ``docs/ContribOperators.md``, ``matmul_nbits.cc``):

* ``B``: uint8 ``[N, blocks, block_size · bits / 8]``: unsigned values, for 4 bits two per byte, low nibble first;
  the padding of the last block holds the block's zero point (it dequantizes to 0 and meets no ``A`` element);
* ``scales``: float32 ``[N · blocks]``, row-major;
* ``zero_points``: uint8, ``[N · blocks]`` for 8 bits, ``[N · ceil(blocks / 2)]`` for 4 bits (each row padded to a
  whole byte, low nibble first). Absent means ``2^(bits-1)`` everywhere.

A signed weight (int4 / int8, zero point ``z``) is stored shifted by ``2^(bits-1)``: ``q_u = q + 2^(bits-1)``,
``z_u = z + 2^(bits-1)``, so ``(q_u − z_u) · s = (q − z) · s`` bit for bit, and a symmetric signed weight needs no
``zero_points`` input. The dequantized weight is exactly the eager one (same integer difference, same float32
multiply), checked against onnxruntime in ``tests/spec/test_matmul_nbits.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PACK_CHUNK_ELEMENTS", "PackedMatMulNBits", "midpoint_zero_points", "pack_matmul_nbits",
           "unpack_matmul_nbits"]


@dataclass(frozen=True)
class PackedMatMulNBits:
    """The ``MatMulNBits`` inputs and attributes of one weight.

    Attributes:
        b: uint8 ``[N, blocks, block_size · bits / 8]``.
        scales: float32 ``[N · blocks]``.
        zero_points: uint8 packed zero points, or None when every one is ``2^(bits-1)``.
        k: Input features.
        n: Output features.
        bits: 4 or 8.
        block_size: Elements per block along ``K``.
    """

    b: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    k: int
    n: int
    bits: int
    block_size: int


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pack unsigned 4-bit values along the last axis (even length), low nibble first."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def midpoint_zero_points(n: int, blocks: int, bits: int) -> np.ndarray:
    """The packed zero points ``MatMulNBits`` assumes when its ``zero_points`` input is absent: ``2^(bits-1)``.

    ``[N · blocks]`` bytes for 8 bits; ``[N · ceil(blocks / 2)]`` for 4 bits, low nibble first and a row's odd last
    block padded with a zero nibble (the layout :func:`pack_matmul_nbits` writes).
    """
    zp = np.full((n, blocks), 1 << (bits - 1), np.uint8)
    if bits == 8:
        return zp.reshape(-1)
    return _pack_nibbles(np.concatenate([zp, np.zeros((n, blocks % 2), np.uint8)], axis=1)).reshape(-1)


#: Elements of ``q`` converted per row chunk in :func:`pack_matmul_nbits` (bounds its int64 temporaries to 8 MiB).
PACK_CHUNK_ELEMENTS = 1 << 20


def pack_matmul_nbits(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int, signed: bool,
                      block_size: int) -> PackedMatMulNBits:
    """Pack ``W = (q − zero_point) · scale`` per block (module docstring).

    Memory: ``q`` may be any integer dtype (or a strided view, e.g. a transpose); it is shifted to unsigned codes
    one chunk of rows at a time (:data:`PACK_CHUNK_ELEMENTS`), so the only weight-sized arrays are the uint8 codes
    and the packed ``B`` (1 and ``bits / 8`` bytes per element), never an int64 copy of ``q``.

    Args:
        q: Integer weight ``[N, K]`` in the dtype's range (e.g. ``[-8, 7]`` for int4).
        scale: ``[N, blocks]`` float32 scales, ``blocks = ceil(K / block_size)``.
        zero_point: ``[N, blocks]`` integer zero points (same dtype range), or None for 0.
        bits: 4 or 8.
        signed: Whether ``q`` / ``zero_point`` are signed (int4 / int8) or unsigned (uint4 / uint8).
        block_size: Elements per block along ``K``.

    Returns:
        The packed inputs.

    Raises:
        ValueError: shapes that do not agree, or ``bits`` other than 4 / 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits packing supports 4 and 8 bits here, got {bits}")
    n, k = q.shape
    blocks = -(-k // block_size)
    if scale.shape != (n, blocks) or (zero_point is not None and zero_point.shape != (n, blocks)):
        raise ValueError(f"scale / zero_point must be [N, blocks] = [{n}, {blocks}] for K={k}, block_size="
                         f"{block_size}; got {scale.shape} / {None if zero_point is None else zero_point.shape}")
    offset = 1 << (bits - 1) if signed else 0
    zp = np.zeros((n, blocks), np.int64) if zero_point is None else zero_point.astype(np.int64)
    zp_u = (zp + offset).astype(np.uint8)
    padded = np.repeat(zp_u, block_size, axis=1)
    rows = max(1, PACK_CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        padded[start:start + rows, :k] = (q[start:start + rows].astype(np.int64) + offset).astype(np.uint8)
    grouped = padded.reshape(n, blocks, block_size)
    b = grouped if bits == 8 else _pack_nibbles(grouped)
    del padded, grouped
    zero_points = None
    if np.any(zp_u != 1 << (bits - 1)):
        if bits == 8:
            zero_points = zp_u.reshape(-1)
        else:
            even = np.concatenate([zp_u, np.zeros((n, blocks % 2), np.uint8)], axis=1)
            zero_points = _pack_nibbles(even).reshape(-1)
    return PackedMatMulNBits(np.ascontiguousarray(b), scale.astype(np.float32).reshape(-1), zero_points, k, n, bits,
                             block_size)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_pack_nibbles`: two unsigned 4-bit values per byte, low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def unpack_matmul_nbits(packed: PackedMatMulNBits) -> np.ndarray:
    """The dequantized weight ``W = (q − zero_point) · scale``, ``[N, K]`` float32, of packed ``MatMulNBits`` inputs.

    Args:
        packed: ``B`` / ``scales`` / ``zero_points`` as :func:`pack_matmul_nbits` writes them (or as read from a
            file's ``MatMulNBits`` node with uint8 zero points).

    Returns:
        ``W`` as onnxruntime dequantizes it (float32 products of the unsigned codes minus the zero point).
    """
    n, k, bits, block = packed.n, packed.k, packed.bits, packed.block_size
    blocks = -(-k // block)
    b = packed.b.reshape(n, blocks, -1).astype(np.uint8)
    codes = (b if bits == 8 else _unpack_nibbles(b)).astype(np.int64)
    if packed.zero_points is None:
        zp = np.full((n, blocks), 1 << (bits - 1), np.int64)
    elif bits == 8:
        zp = packed.zero_points.reshape(n, blocks).astype(np.int64)
    else:
        zp = _unpack_nibbles(packed.zero_points.reshape(n, -1).astype(np.uint8))[:, :blocks].astype(np.int64)
    scale = packed.scales.reshape(n, blocks).astype(np.float32)
    weight = (codes - zp[..., None]).astype(np.float32) * scale[..., None]
    return weight.reshape(n, blocks * block)[:, :k]
