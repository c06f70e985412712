"""How a weight-only linear computes in onnxruntime: the ``matmul_compute`` registry and the block-size rule.

A weight-only linear (quantized weight, float input) is written to ONNX as onnxruntime's ``com.microsoft``
``MatMulNBits`` with an explicit ``accuracy_level``, so what onnxruntime runs is what the spec asked for. The weight
spec's ``matmul_compute`` field names one entry of :data:`MATMUL_COMPUTE`:

* ``"float"`` (default): ``accuracy_level=1``: the weight is dequantized and multiplied in float32, exactly what the
  eager model computes (the two differ by float accumulation order only).
* ``"int8"``: ``accuracy_level=4``: onnxruntime quantizes the activation to int8 per row and per block of
  ``block_size`` along ``K`` (``amax / 127``) and accumulates integer products: faster, less accurate. The eager
  model applies the same activation quantization
  (:func:`~coreai_opt.quantization.matmul_nbits.int8_compute.int8_compute_activation`) in front of the linear, so
  eager and
  onnxruntime agree and the accuracy cost shows in eager too.

``MatMulNBits`` needs one block size per weight (:func:`matmul_nbits_block_size`, shared by the eager emulation and
the ONNX rule): a per-block weight uses its own block (a power of two, at least 16); a per-channel or per-tensor
weight is written as blocks of ``min(256, the power of two >= max(16, K))`` with its scale repeated (onnxruntime
accepts a block longer than ``K``, zero-padded). Measured on onnxruntime 1.32 (``tests/spec/test_matmul_nbits.py``):
with int8 compute a block above 256 quantizes the activation in blocks of 256, not of the block size, so int8
compute accepts weight blocks of 16 to 256 only; float compute accepts any power of two from 16.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreai_opt.quantization.spec.granularity import Granularity, PerBlock

__all__ = [
    "MatMulCompute",
    "MATMUL_COMPUTE",
    "MATMUL_COMPUTE_BITS",
    "INT8_COMPUTE_MAX_BLOCK",
    "get_matmul_compute",
    "matmul_nbits_block_size",
    "block_size_problem",
]

#: Weight widths ``MatMulNBits`` stores (int4 / uint4 and int8 / uint8).
MATMUL_COMPUTE_BITS: frozenset[int] = frozenset({4, 8})
#: Largest block whose int8 compute quantizes the activation per block of that size (onnxruntime 1.32, measured).
INT8_COMPUTE_MAX_BLOCK = 256
_MIN_BLOCK = 16


@dataclass(frozen=True)
class MatMulCompute:
    """One way ``MatMulNBits`` computes.

    Attributes:
        name: Registry key (the value of ``QuantizationSpec.matmul_compute``).
        accuracy_level: The ``MatMulNBits`` attribute written for it.
        quantizes_activation: Whether onnxruntime quantizes the activation (and the eager model emulates it).
        description: One line for docs and errors.
    """

    name: str
    accuracy_level: int
    quantizes_activation: bool
    description: str


#: ``matmul_compute`` key -> :class:`MatMulCompute`.
MATMUL_COMPUTE: dict[str, MatMulCompute] = {
    c.name: c
    for c in (
        MatMulCompute("float", 1, False, "dequantize the weight, float32 products (eager-equal)"),
        MatMulCompute("int8", 4, True, "int8 activation per row and K block (amax/127), integer products (faster; "
                                       "the eager model emulates the activation quantization)"),
    )
}


def get_matmul_compute(name: str) -> MatMulCompute:
    """The registry entry ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if name not in MATMUL_COMPUTE:
        raise ValueError(f"unknown matmul_compute {name!r}; valid choices: {', '.join(MATMUL_COMPUTE)}")
    return MATMUL_COMPUTE[name]


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def block_size_problem(block_size: int, compute: str) -> str | None:
    """Why ``MatMulNBits`` cannot use a weight block of ``block_size`` under ``compute`` (None when it can)."""
    if block_size < _MIN_BLOCK or not _is_power_of_two(block_size):
        return f"block size {block_size} is not a power of two >= {_MIN_BLOCK}"
    if get_matmul_compute(compute).quantizes_activation and block_size > INT8_COMPUTE_MAX_BLOCK:
        return (f"block size {block_size} is above {INT8_COMPUTE_MAX_BLOCK}, where onnxruntime's int8 compute "
                f"quantizes the activation in blocks of {INT8_COMPUTE_MAX_BLOCK} instead")
    return None


def matmul_nbits_block_size(granularity: Granularity | None, k: int, weight_block: int | None = None) -> int:
    """The ``MatMulNBits`` block size of a weight with ``K`` input features.

    Args:
        granularity: The weight's granularity (per-block: its ``block_size``; otherwise one block per row).
            None: use ``weight_block`` (0 or None for one block per row).
        k: Input features ``K`` (the reduced dimension).
        weight_block: The block size read from an ONNX ``DequantizeLinear`` when there is no spec.

    Returns:
        The weight's own block size, or ``min(256, the power of two >= max(16, K))`` for a weight with one scale
        per row (or per tensor).
    """
    block = granularity.block_size if isinstance(granularity, PerBlock) else (weight_block or 0)
    if block:
        return block
    padded = _MIN_BLOCK
    while padded < k and padded < INT8_COMPUTE_MAX_BLOCK:
        padded *= 2
    return padded
