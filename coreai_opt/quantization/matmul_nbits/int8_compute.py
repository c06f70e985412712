"""Eager emulation of onnxruntime's int8-compute ``MatMulNBits`` (``accuracy_level=4``, ``SQNBIT_CompInt8``).

With ``accuracy_level=4`` onnxruntime's CPU ``MatMulNBits`` does not multiply the float activation ``A`` by the
dequantized weight: it first quantizes ``A`` to int8, per row, per block of ``block_size`` along ``K`` (the same
blocks as the weight), and accumulates int8 × int4/int8 products in int32. For row ``m`` and block ``b``::

    amax   = max_k |A[m, k]|                    over the block (a short last block is zero-padded)
    s_a    = amax / 127                          float32
    inv    = 127 / amax   (0 when amax = 0)      float32, computed directly, not as 1 / s_a
    q_a[k] = round_half_even(A[m, k] · inv)      in [-127, 127]: symmetric, no zero point
    C[m, n] = bias[n] + Σ_b s_a[m, b] · s_w[n, b] · Σ_{k ∈ b} q_a[k] · (q_w[n, k] − z_w[n, b])

so the eager equivalent is ``int8_compute_activation(A, block_size) @ W_dequantized.T``: the activation fake
quantization is bit-exact, and the two sides then differ only by float32 accumulation order, at most
``2 · γ_(K+3) · Σ_k |a_k · w_k|`` per output element with ``γ_n = n · 2^-24 / (1 − n · 2^-24)``
(:func:`accumulation_bound`; ``tests/spec/test_int8_compute.py`` checks both against onnxruntime's own node).

Source (onnxruntime ``main``, the ``MatMulNBits`` of onnxruntime 1.32):

* ``onnxruntime/contrib_ops/cpu/quantization/matmul_nbits.cc`` — ``GetComputeType``: ``accuracy_level == 4`` and
  ``MlasIsQNBitGemmAvailable(nbits, block_size, SQNBIT_CompInt8)`` selects ``SQNBIT_CompInt8`` ("input int8,
  accumulator int32"), otherwise ``SQNBIT_CompFp32``.
* ``onnxruntime/core/mlas/lib/sqnbitgemm_kernel_avx512.cpp`` — ``QuantizeARow_CompInt8_avx512`` (also the A
  quantizer of the AVX-512-VNNI dispatch): block max of ``|a|``, ``scale = maxScalar / 127.f``,
  ``inverse_scale = 127.f / maxScalar``, ``_mm512_roundscale_ps(v · inverse_scale, _MM_ROUND_NEAREST)`` (ties to
  even), int8 store; a partial last block is zero-filled.
* ``onnxruntime/test/mlas/unittest/test_sqnbitgemm_2bit_gemm.cpp`` — ``QuantizeA_Reference`` /
  ``ReferenceGemm_W2_CompInt8`` restate the same formula (and why ``127 / amax`` is not ``1 / (amax / 127)``).

CPUs without an int8 kernel for a (bits, block_size) pair fall back to float compute; the emulation then does not
apply (``coreai_opt.onnx.verify.ort_kernels`` reads the optimized graph to tell which kernel ran).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["INT8_COMPUTE_QMAX", "int8_compute_activation", "accumulation_bound"]

#: Symmetric int8 range of the activation: ``[-127, 127]``.
INT8_COMPUTE_QMAX: int = 127

_FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def _check(x: Tensor, block_size: int) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"int8_compute_activation needs a float32 activation, got {x.dtype}; cast it to float32 "
                        "(onnxruntime's int8 MatMulNBits quantizes float32 A)")
    if x.dim() == 0:
        raise ValueError("int8_compute_activation needs an activation with a K (last) dimension, got a scalar")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (onnxruntime's MatMulNBits block sizes), "
                         f"got {block_size}")


def int8_compute_activation(x: Tensor, block_size: int) -> Tensor:
    """Fake-quantize ``x`` the way int8-compute ``MatMulNBits`` quantizes its ``A`` input.

    Per row (every index but the last) and per block of ``block_size`` along the last dimension ``K``:
    ``s = amax / 127``, ``q = round_half_even(x · (127 / amax))``, result ``q · s`` (all float32; an all-zero block
    stays zero).

    Args:
        x: float32 activation ``[..., K]``.
        block_size: The weight's block size along ``K`` (a power of two, at least 16).

    Returns:
        The dequantized int8 activation, same shape and dtype as ``x``.

    Raises:
        TypeError: ``x`` is not float32.
        ValueError: ``x`` is a scalar or ``block_size`` is not a power of two >= 16.
    """
    _check(x, block_size)
    k = x.shape[-1]
    blocks = -(-k // block_size)
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - k)) if blocks * block_size != k else x
    grouped = padded.reshape(*x.shape[:-1], blocks, block_size)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    qmax = torch.tensor(float(INT8_COMPUTE_QMAX), dtype=torch.float32)
    scale = amax / qmax
    inverse = torch.where(amax != 0, qmax / torch.where(amax != 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.clamp(torch.round(grouped * inverse), -INT8_COMPUTE_QMAX, INT8_COMPUTE_QMAX)
    return (q * scale).reshape(*x.shape[:-1], blocks * block_size)[..., :k]


def accumulation_bound(a: Tensor, weight: Tensor) -> Tensor:
    """Float32 accumulation bound of ``a @ weight.T`` per output element: ``2 · γ_(K+3) · (|a| @ |weight|.T)``.

    ``γ_n = n·u / (1 − n·u)`` with ``u = 2^-24`` bounds the relative rounding error of a float32 dot product with
    ``n`` rounded operations in any summation order. Eager rounds each factor (``q·s``), each product and ``K − 1``
    sums (``K + 2``); onnxruntime's int32 dot product is exact and only its per-block float multiply-adds round
    (fewer). Each side is within ``γ_(K+3) · Σ|a_k w_k|`` of the exact value, so they differ by at most twice that.

    Args:
        a: ``[..., K]`` (the fake-quantized activation).
        weight: ``[N, K]`` (the dequantized weight).

    Returns:
        ``[..., N]`` float64 bound ``2 · γ_(K+3) · Σ_k |a_k| |w_nk|``.
    """
    k = a.shape[-1]
    n = (k + 3) * _FLOAT32_UNIT_ROUNDOFF
    gamma = n / (1.0 - n)
    return 2.0 * gamma * (a.abs().double() @ weight.abs().double().T)
