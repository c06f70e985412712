"""A hand-built onnxruntime ``MatMulNBits`` node (onnx.helper) with random blocked weights, for parity tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper


@dataclass(frozen=True)
class MatMulNBitsCase:
    """One ``MatMulNBits`` model and the weight it encodes.

    Attributes:
        model: ``Y = MatMulNBits(A)`` with ``A: [M, K]`` float32.
        weight: Dequantized weight ``[N, K]`` float32: ``(q - zero_point) * scale`` per block.
    """

    model: onnx.ModelProto
    weight: np.ndarray


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint values along the last axis, low bits first (2 per byte for 4-bit)."""
    if bits == 8:
        return values.astype(np.uint8)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def matmul_nbits_case(m: int, k: int, n: int, bits: int, block_size: int, accuracy_level: int,
                      rng: np.random.Generator) -> MatMulNBitsCase:
    """Random asymmetric blocked weights (a zero point per block) as a ``com.microsoft.MatMulNBits`` model."""
    blocks = -(-k // block_size)
    qmax = (1 << bits) - 1
    q = rng.integers(0, qmax + 1, size=(n, blocks * block_size)).astype(np.uint8)
    q[:, k:] = 0
    scale = (rng.random((n, blocks)) * 0.05 + 0.01).astype(np.float32)
    zero_point = rng.integers(0, qmax + 1, size=(n, blocks)).astype(np.uint8)
    packed_q = _pack(q, bits).reshape(n, blocks, -1)
    padded_zp = np.concatenate([zero_point, np.zeros((n, blocks % 2), np.uint8)], 1) if bits == 4 else zero_point
    packed_zp = _pack(padded_zp, bits)
    weight = (q[:, :k].astype(np.float32) - np.repeat(zero_point, block_size, 1)[:, :k]) * np.repeat(
        scale, block_size, 1)[:, :k]
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block_size, accuracy_level=accuracy_level)
    initializers = [
        helper.make_tensor("B", TensorProto.UINT8, packed_q.shape, packed_q.tobytes(), raw=True),
        helper.make_tensor("scales", TensorProto.FLOAT, [n * blocks], scale.reshape(-1)),
        helper.make_tensor("zero_points", TensorProto.UINT8, [packed_zp.size], packed_zp.tobytes(), raw=True),
    ]
    graph = helper.make_graph([node], "matmul_nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])], initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return MatMulNBitsCase(model, weight.astype(np.float32))
