"""Hypothesis properties of ``coreai_opt::quantize_dequantize``: eager equals onnxruntime, and fake-quant invariants.

The ONNX model is exported once (dynamic shapes; x, scale and zero points are graph inputs), holding every dtype
at every granularity with the full range and a narrowed range, so examples only re-run the session.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import onnxruntime as ort
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.export import Dim

from coreai_opt.quantization.spec import SUPPORTED_DTYPES, get_dtype_info, quantize_dequantize

BLOCK = 4
GRANULARITIES = (("per_tensor", 0, 0), ("per_channel", 1, 0), ("per_block", 1, BLOCK))


def _ranges(dtype: str) -> list[tuple[int, int]]:
    """Full dtype range, plus a narrowed one (needs the exact clamp in ONNX) for integer dtypes."""
    info = get_dtype_info(dtype)
    full = (int(info.quant_min), int(info.quant_max))
    return [full] if info.is_float else [full, (full[0] + 1, full[1] - 2)]


def _outputs(x: Tensor, scale: Tensor, zps: list[Tensor], axis: int, block: int) -> list[Tensor]:
    return [
        quantize_dequantize(x, scale, zp, qmin, qmax, axis, block, dtype)
        for dtype, zp in zip(SUPPORTED_DTYPES, zps, strict=True)
        for qmin, qmax in _ranges(dtype)
    ]


class _Everything(nn.Module):
    def forward(self, x_pt: Tensor, s_pt: Tensor, z_pt: list[Tensor], x_pc: Tensor, s_pc: Tensor,
                z_pc: list[Tensor], x_pb: Tensor, s_pb: Tensor, z_pb: list[Tensor]) -> tuple[Tensor, ...]:
        return (*_outputs(x_pt, s_pt, z_pt, 0, 0), *_outputs(x_pc, s_pc, z_pc, 1, 0),
                *_outputs(x_pb, s_pb, z_pb, 1, BLOCK))


@functools.lru_cache(maxsize=1)
def _session() -> ort.InferenceSession:
    from conftest import _export_onnx_model, _ort_session

    rows, cols, blocks = Dim("rows", min=1, max=64), Dim("cols", min=1, max=64), Dim("blocks", min=1, max=16)
    rows_b = Dim("rows_b", min=1, max=64)
    n = len(SUPPORTED_DTYPES)
    # Distinct example tensors: the exporter would merge one tensor object passed several times into one input.
    args = (torch.randn(3, 5), torch.tensor(0.1), [torch.tensor(0, dtype=torch.int32) for _ in range(n)],
            torch.randn(3, 5), torch.full((5,), 0.1), [torch.zeros(5, dtype=torch.int32) for _ in range(n)],
            torch.randn(3, 8), torch.full((3, 2), 0.1), [torch.zeros(3, 2, dtype=torch.int32) for _ in range(n)])
    dynamic = {
        "x_pt": {0: rows, 1: cols}, "s_pt": None, "z_pt": [None] * n,
        "x_pc": {0: rows, 1: cols}, "s_pc": {0: cols}, "z_pc": [{0: cols}] * n,
        "x_pb": {0: rows_b, 1: BLOCK * blocks}, "s_pb": {0: rows_b, 1: blocks}, "z_pb": [{0: rows_b, 1: blocks}] * n,
    }
    return _ort_session(_export_onnx_model(_Everything(), args, 21, dynamic_shapes=dynamic))


@st.composite
def _case(draw: st.DrawFn) -> dict[str, object]:
    rows = draw(st.integers(1, 5))
    cols = draw(st.integers(1, 6))
    blocks = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    log2_scale = draw(st.floats(-12.0, 4.0))
    return {"rows": rows, "cols": cols, "blocks": blocks, "seed": seed, "log2_scale": log2_scale}


def _inputs(case: dict[str, object], qparam_shape: tuple[int, ...], x_shape: tuple[int, ...],
            gen: torch.Generator) -> tuple[Tensor, Tensor, list[Tensor]]:
    base = 2.0 ** float(case["log2_scale"])  # type: ignore[arg-type]
    scale = (base * (0.5 + torch.rand(qparam_shape, generator=gen))).float()
    zps = []
    for dtype in SUPPORTED_DTYPES:
        info = get_dtype_info(dtype)
        if info.is_float:
            zps.append(torch.zeros(qparam_shape, dtype=torch.int32))
        else:
            zps.append(torch.randint(int(info.quant_min), int(info.quant_max) + 1, qparam_shape, generator=gen,
                                     dtype=torch.int32))
    # Values: ties (k + 0.5)·s near zero and far out, multiples of s, and a wide Gaussian beyond every range.
    s_full = scale if scale.dim() == 0 else (scale.reshape(1, -1) if len(qparam_shape) == 1 else
                                             scale.repeat_interleave(BLOCK, dim=1))
    small = torch.randint(-10, 10, x_shape, generator=gen).float()
    big = torch.randint(-40000, 40000, x_shape, generator=gen).float()
    kind = torch.randint(0, 4, x_shape, generator=gen)
    wide = torch.randn(x_shape, generator=gen) * base * 10.0 ** torch.randint(0, 6, x_shape, generator=gen)
    choices = torch.stack([(small + 0.5) * s_full, (big + 0.5) * s_full, big * s_full, wide])
    x = choices.gather(0, kind.unsqueeze(0)).squeeze(0)
    return x.float(), scale, zps


def _check_invariants(x: Tensor, scale: Tensor, zp: Tensor, qmin: int, qmax: int, axis: int, block: int,
                      dtype: str, y: Tensor) -> None:
    info = get_dtype_info(dtype)
    s = scale if scale.dim() == 0 else (scale.reshape(1, -1) if block == 0 else
                                        scale.repeat_interleave(block, dim=1))
    # fq(fq(x)) == fq(x)
    assert torch.equal(quantize_dequantize(y, scale, zp, qmin, qmax, axis, block, dtype), y), dtype
    if info.is_float:
        assert bool((y.abs() <= float(info.quant_max) * s).all())
        return
    z = zp if zp.dim() == 0 else (zp.reshape(1, -1) if block == 0 else zp.repeat_interleave(block, dim=1))
    # q = round(y / s) + z stays in [qmin, qmax]
    q = torch.round(y / s) + z
    assert bool(((q >= qmin) & (q <= qmax)).all()), dtype
    # |x − fq(x)| <= s/2 wherever x is inside the range (round(x / s) + z not clamped), up to the float32
    # rounding of x / s and of (q − z)·s: a few ulps of |x|.
    inside = ((torch.round(x / s) + z) >= qmin) & ((torch.round(x / s) + z) <= qmax)
    bound = (0.5 * s + x.abs() * 2.0**-22).expand_as(x)
    assert bool(((x - y).abs()[inside] <= bound[inside]).all()), dtype


@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=_case())
def test_quantize_dequantize_eager_equals_onnxruntime_and_keeps_invariants(case: dict[str, object]) -> None:
    """Invariants: ORT == eager bit-exactly; q ∈ [qmin, qmax]; fq(fq(x)) == fq(x); |x − fq(x)| ≤ s/2 in range."""
    gen = torch.Generator().manual_seed(int(case["seed"]))  # type: ignore[arg-type]
    rows, cols, blocks = int(case["rows"]), int(case["cols"]), int(case["blocks"])  # type: ignore[arg-type]
    x_pt, s_pt, z_pt = _inputs(case, (), (rows, cols), gen)
    x_pc, s_pc, z_pc = _inputs(case, (cols,), (rows, cols), gen)
    x_pb, s_pb, z_pb = _inputs(case, (rows, blocks), (rows, BLOCK * blocks), gen)
    feeds_list = [x_pt, s_pt, *z_pt, x_pc, s_pc, *z_pc, x_pb, s_pb, *z_pb]
    session = _session()
    assert len(session.get_inputs()) == len(feeds_list)
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), feeds_list, strict=True)})
    expected = _Everything()(x_pt, s_pt, z_pt, x_pc, s_pc, z_pc, x_pb, s_pb, z_pb)
    assert len(got) == len(expected) == 3 * sum(len(_ranges(d)) for d in SUPPORTED_DTYPES)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e.numpy())
    i = 0
    for (_, axis, block), (x, scale, zps) in zip(GRANULARITIES, ((x_pt, s_pt, z_pt), (x_pc, s_pc, z_pc),
                                                                  (x_pb, s_pb, z_pb)), strict=True):
        for dtype, zp in zip(SUPPORTED_DTYPES, zps, strict=True):
            for qmin, qmax in _ranges(dtype):
                _check_invariants(x, scale, zp, qmin, qmax, axis, block, dtype, expected[i])
                i += 1
    assert math.isfinite(float(case["log2_scale"]))  # type: ignore[arg-type]
