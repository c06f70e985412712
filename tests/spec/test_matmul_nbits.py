"""pack_matmul_nbits: the packed onnxruntime MatMulNBits node alone against the eager linear, per dtype and layout.

Float compute (accuracy_level=1) must equal ``x @ W.T`` within float32 accumulation; int8 compute
(accuracy_level=4) must equal ``int8_compute_activation(x, block) @ W.T`` within the same bound, with the block
size :func:`matmul_nbits_block_size` picks (per-channel weights: one block per row, capped at 256).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.quantization.matmul_nbits.int8_compute import accumulation_bound, int8_compute_activation
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation
from coreai_opt.quantization.matmul_nbits.packing import pack_matmul_nbits, unpack_matmul_nbits
from coreai_opt.quantization.spec import PerBlock, PerChannel, QuantizationSpec
from coreai_opt.quantization.spec.matmul_compute import block_size_problem, matmul_nbits_block_size

_RANGES = {"int4": (-8, 7, 4, True), "uint4": (0, 15, 4, False), "int8": (-128, 127, 8, True),
           "uint8": (0, 255, 8, False)}


def _node_model(packed, m: int, accuracy_level: int):
    inputs = ["A", "B", "scales"] + (["zero_points"] if packed.zero_points is not None else [])
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=packed.k, N=packed.n,
                            bits=packed.bits, block_size=packed.block_size, accuracy_level=accuracy_level)
    inits = [numpy_helper.from_array(packed.b, "B"), numpy_helper.from_array(packed.scales, "scales")]
    if packed.zero_points is not None:
        inits.append(numpy_helper.from_array(packed.zero_points, "zero_points"))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, packed.k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, packed.n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _weight(dtype: str, n: int, k: int, block: int, asymmetric: bool, rng: np.random.Generator):
    lo, hi, bits, signed = _RANGES[dtype]
    blocks = -(-k // block)
    q = rng.integers(lo, hi + 1, size=(n, k))
    scale = (rng.random((n, blocks)) * 0.05 + 0.01).astype(np.float32)
    zp = rng.integers(lo, hi + 1, size=(n, blocks)) if asymmetric else (None if signed else
                                                                         np.full((n, blocks), (hi + 1) // 2))
    z = np.zeros((n, blocks)) if zp is None else zp
    weight = ((q - np.repeat(z, block, 1)[:, :k]).astype(np.float32) * np.repeat(scale, block, 1)[:, :k])
    return pack_matmul_nbits(q, scale, zp, bits, signed, block), torch.from_numpy(weight.astype(np.float32))


# (dtype, K, granularity, asymmetric): per-channel -> one block per row (K=96 -> 128 > K; K=300 -> 256, 2 blocks)
CASES = [("int8", 96, PerChannel(0), False), ("int8", 300, PerChannel(0), False),
         ("uint8", 64, PerChannel(0), True), ("int4", 256, PerBlock(1, 32), False),
         ("int4", 200, PerBlock(1, 32), True), ("uint4", 160, PerBlock(1, 64), True), ("int4", 96, PerChannel(0), True),
         ("int8", 256, PerBlock(1, 128), True), ("uint4", 512, PerBlock(1, 256), False)]


@pytest.mark.parametrize(("dtype", "k", "granularity", "asymmetric"), CASES)
@pytest.mark.parametrize("accuracy_level", [1, 4])
def test_packed_matmul_nbits_equals_the_eager_linear_within_float_accumulation(
    dtype: str, k: int, granularity, asymmetric: bool, accuracy_level: int
) -> None:
    rng = np.random.default_rng(k + len(dtype))
    block = matmul_nbits_block_size(granularity, k)
    packed, weight = _weight(dtype, 24, k, block, asymmetric, rng)
    a = (rng.standard_normal((9, k)) * 2).astype(np.float32)
    a[1] = 0.0
    got = _node_model(packed, 9, accuracy_level).run(None, {"A": a})[0].astype(np.float64)
    x = torch.from_numpy(a)
    if accuracy_level == 4:
        x = Int8ComputeActivation(block)(x)
        assert torch.equal(x, int8_compute_activation(torch.from_numpy(a), block))
    eager = (x @ weight.T).double().numpy()
    assert (np.abs(got - eager) <= accumulation_bound(x, weight).numpy()).all()
    if accuracy_level == 4:  # the emulation is what makes them agree: plain float is far off
        plain = (torch.from_numpy(a) @ weight.T).double().numpy()
        assert np.abs(got - plain).max() > 10 * accumulation_bound(x, weight).numpy().max()


@pytest.mark.parametrize(("dtype", "k", "granularity", "asymmetric"), CASES)
def test_unpack_matmul_nbits_returns_the_packed_weight_bit_for_bit(dtype: str, k: int, granularity,
                                                                   asymmetric: bool) -> None:
    rng = np.random.default_rng(3 * k + len(dtype))
    block = matmul_nbits_block_size(granularity, k)
    packed, weight = _weight(dtype, 7, k, block, asymmetric, rng)
    unpacked = unpack_matmul_nbits(packed)
    assert unpacked.shape == (7, k) and unpacked.dtype == np.float32
    assert np.array_equal(unpacked, weight.numpy())  # (q - z) * s in float32, as onnxruntime dequantizes


def test_block_size_rule_for_per_channel_weights_and_the_limits_of_int8_compute() -> None:
    assert [matmul_nbits_block_size(PerChannel(0), k) for k in (8, 16, 17, 96, 256, 257, 4096)] == [
        16, 16, 32, 128, 256, 256, 256]
    assert matmul_nbits_block_size(PerBlock(1, 64), 4096) == 64
    assert matmul_nbits_block_size(None, 300, weight_block=0) == 256
    assert block_size_problem(48, "float") == "block size 48 is not a power of two >= 16"
    assert block_size_problem(8, "int8") == "block size 8 is not a power of two >= 16"
    assert block_size_problem(512, "float") is None and "above 256" in block_size_problem(512, "int8")


def test_signed_symmetric_weights_need_no_zero_points_and_unsigned_ones_carry_theirs() -> None:
    rng = np.random.default_rng(3)
    sym, _ = _weight("int4", 4, 64, 32, False, rng)
    assert sym.zero_points is None and sym.b.shape == (4, 2, 16) and sym.scales.shape == (8,)
    q = np.array([[-8, 7, 0, 1] + [0] * 12])
    packed = pack_matmul_nbits(q, np.ones((1, 1), np.float32), np.array([[-1]]), 4, True, 16)
    assert packed.b[0, 0, :2].tolist() == [0 | (15 << 4), 8 | (9 << 4)]  # low nibble first, +8 shift
    assert packed.zero_points.tolist() == [7]  # -1 + 8, one row of one block padded to a byte
    odd = pack_matmul_nbits(np.zeros((2, 40), np.int64), np.ones((2, 3), np.float32), np.full((2, 3), 3), 4, False, 16)
    assert odd.zero_points.tolist() == [0x33, 0x03, 0x33, 0x03]  # rows padded to whole bytes
    assert odd.b[0, 2, 4:].tolist() == [0x33] * 4  # padding of the last block holds the zero point


def test_spec_refuses_int8_compute_it_cannot_run_with_the_fix() -> None:
    with pytest.raises(ValueError, match="4- or 8-bit integer weights"):
        QuantizationSpec(dtype="int16", matmul_compute="int8")
    with pytest.raises(ValueError, match="block size 512 is above 256"):
        QuantizationSpec(dtype="int4", granularity=PerBlock(1, 512), matmul_compute="int8")
    with pytest.raises(ValueError, match="valid choices: float, int8"):
        QuantizationSpec(dtype="int8", matmul_compute="fp16")
    spec = QuantizationSpec(dtype="int4", granularity=PerBlock(1, 32), matmul_compute="int8")
    assert QuantizationSpec.from_dict(spec.to_dict()) == spec
    assert "matmul_compute" not in QuantizationSpec(dtype="int8").to_dict()  # default: dicts as before the field
