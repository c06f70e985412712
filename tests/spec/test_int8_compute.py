"""int8_compute_activation against onnxruntime's own int8-compute MatMulNBits node (accuracy_level=4)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from coreai_opt.quantization.matmul_nbits.int8_compute import accumulation_bound, int8_compute_activation
from tests.matmul_nbits_graphs import matmul_nbits_case

CASES = [(bits, block, k) for bits in (4, 8) for block in (32, 128) for k in (32, 96, 200, 256, 512)]


def _run(model, a: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


@pytest.mark.parametrize(("bits", "block_size", "k"), CASES)
def test_int8_compute_matmul_agrees_with_onnxruntime_matmul_nbits_within_float_accumulation(
    bits: int, block_size: int, k: int
) -> None:
    rng = np.random.default_rng(bits * 1000 + block_size + k)
    case = matmul_nbits_case(9, k, 24, bits, block_size, accuracy_level=4, rng=rng)
    a = (rng.standard_normal((9, k)) * 2).astype(np.float32)
    a[0, :16] = 0.0  # an all-zero block start (and, for k = 32 / block 32, a row block with a zero amax part)
    a[1, :] = 0.0  # an all-zero row: amax 0, scale 0
    got = _run(case.model, a).astype(np.float64)
    a_fq = int8_compute_activation(torch.from_numpy(a), block_size)
    weight = torch.from_numpy(case.weight)
    eager = (a_fq @ weight.T).double()
    bound = accumulation_bound(a_fq, weight)
    assert (np.abs(got - eager.numpy()) <= bound.numpy()).all()
    assert (got[1] == 0.0).all()
    # without the emulation the same node is far outside that bound (what verify_onnx sees on weight-only presets)
    plain = (torch.from_numpy(a) @ weight.T).double().numpy()
    assert np.abs(got - plain).max() > 10 * bound.numpy().max()


@pytest.mark.parametrize(("bits", "block_size"), [(4, 32), (8, 128)])
def test_accuracy_level_1_matmul_nbits_computes_in_float_without_activation_quantization(bits: int,
                                                                                         block_size: int) -> None:
    rng = np.random.default_rng(7)
    case = matmul_nbits_case(5, 256, 16, bits, block_size, accuracy_level=1, rng=rng)
    a = rng.standard_normal((5, 256)).astype(np.float32)
    got = _run(case.model, a).astype(np.float64)
    a_t, weight = torch.from_numpy(a), torch.from_numpy(case.weight)
    assert (np.abs(got - (a_t @ weight.T).double().numpy()) <= accumulation_bound(a_t, weight).numpy()).all()


def test_int8_compute_activation_values_are_symmetric_int8_steps_of_the_block_max() -> None:
    x = torch.tensor([[1.27, -0.635, 0.005, 0.015] + [0.0] * 12 + [2.0] + [0.0] * 15])
    y = int8_compute_activation(x, 16)
    scale_0, scale_1 = torch.tensor(1.27) / 127, torch.tensor(2.0) / 127
    q0 = torch.round(x[0, :16] * (torch.tensor(127.0) / 1.27))
    assert torch.equal(y[0, :16], q0 * scale_0)
    assert q0[:4].tolist() == [127.0, -64.0, 0.0, 2.0]  # -63.5 and 0.5 / 1.5 round half to even
    assert torch.equal(y[0, 16], torch.tensor(2.0) / 127 * 127) and float(y[0, 16]) == pytest.approx(2.0)
    assert torch.equal(y[0, 17:], torch.zeros(15)) and scale_1 > 0


def test_int8_compute_activation_zero_pads_a_short_last_block_and_keeps_the_shape() -> None:
    x = torch.randn(2, 3, 40)
    y = int8_compute_activation(x, 32)
    assert y.shape == x.shape
    last = x[..., 32:]
    scale = last.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(y[..., 32:], torch.round(last * (127 / last.abs().amax(-1, keepdim=True))) * scale)


def test_int8_compute_activation_rejects_bad_inputs_with_the_fix() -> None:
    with pytest.raises(TypeError, match="float32"):
        int8_compute_activation(torch.randn(2, 32, dtype=torch.float64), 32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        int8_compute_activation(torch.randn(2, 32), 24)
    with pytest.raises(ValueError, match="scalar"):
        int8_compute_activation(torch.tensor(1.0), 16)
