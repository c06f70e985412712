"""Eager's quantizer calls forced to given codes (coreai_opt.onnx.verify.quantize_calls.ForceQuantizeCalls)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.verify.quantize_calls import ForceQuantizeCalls, RecordQuantizeCalls


def _converted() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    prepared = co.prepare(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    return co.convert(prepared), x


def test_a_forced_call_keeps_eagers_own_result_and_later_ops_read_the_given_codes_dequantized():
    model, x = _converted()
    with torch.no_grad(), RecordQuantizeCalls(set(range(8)), (x,)) as recorder:
        expected = model(x)
    activations = sorted(recorder.activations)
    first, last = activations[0], activations[-1]  # the input's quantizer, the output's
    _, scale, zero_point = recorder.calls[first]
    codes = np.full((8, 4), int(zero_point) + 7, dtype=np.uint8 if int(zero_point) > 0 else np.int8)
    with torch.no_grad(), ForceQuantizeCalls({first: codes}) as forcing:
        forced_out = model(x)
    own, _, _ = forcing.calls[first]
    torch.testing.assert_close(own, recorder.calls[first][0], rtol=0, atol=0)  # eager's own, before the forcing
    constant_input = torch.full((8, 4), 7.0) * scale  # (q - z) · s, the op's dequantization
    with torch.no_grad():
        assert torch.equal(forced_out, model(constant_input))  # the layer read exactly the forced values
    assert not torch.equal(forced_out, expected) and last not in forcing.calls


def test_codes_that_do_not_fit_the_call_leave_eagers_output():
    model, x = _converted()
    with torch.no_grad():
        expected = model(x)
        with ForceQuantizeCalls({0: np.zeros(5, dtype=np.int8)}) as forcing:
            assert torch.equal(model(x), expected)
    assert 0 in forcing.calls


def test_a_one_step_flip_at_a_near_tie_is_the_kernels_rounding_and_a_flip_away_from_one_stays():
    """x / s within NEAR_TIE of k + 1/2: onnxruntime's k + 1 is kept as eager's own; at k + 0.3 it is a difference."""
    model, x = _converted()
    with torch.no_grad(), RecordQuantizeCalls(set(range(8)), (x,)) as recorder:
        model(x)
    first = sorted(recorder.activations)[0]  # the input's quantizer (per tensor)
    _, scale, zero_point = recorder.calls[first]
    s, z = float(scale), int(zero_point)
    k = torch.tensor([3.0, 3.0, -2.0, 5.0]).repeat(8, 1)
    offset = torch.tensor([0.5 - 2e-4, 0.3, 0.5 - 5e-4, 0.2]).repeat(8, 1)  # near, far, near, far
    inputs = ((k + offset) * s).float()
    forced = (k + 1 + z).numpy().astype(np.uint8 if z > 0 else np.int8)
    with torch.no_grad(), ForceQuantizeCalls({first: forced}) as forcing:
        model(inputs)
    own = forcing.calls[first][0].float() - z
    near = torch.tensor([True, False, True, False]).repeat(8, 1)
    assert torch.equal(own[near], (k + 1)[near])  # adopted: the kernel's side of a near tie
    assert torch.equal(own[~near], k[~near])  # eager's own rounding: the difference stays for the rules
    assert forcing.near_ties[first] == 16
