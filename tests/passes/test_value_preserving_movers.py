"""A cast to the tensor's own dtype, and a tensor_split, move no value: they share their input's quantizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind


class _EagerAttention(nn.Module):
    """transformers' eager attention tail: ``softmax(scores, dtype=float32).to(query.dtype) @ value``, with a causal
    mask so row 0 attends to one position and its probability is exactly 1."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.cast = cast
        self.register_buffer("causal", torch.ones(6, 6, dtype=torch.bool).triu(1))

    def forward(self, scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.masked_fill(self.causal, -1e4), dim=-1, dtype=torch.float32)
        probs = probs.to(value.dtype) if self.cast == "to" else probs.type_as(value)  # Gemma 3n: type_as
        return probs @ value


@pytest.mark.parametrize("cast", ["to", "type_as"])
@pytest.mark.parametrize("capture", ["export", "fx"])
def test_a_same_dtype_cast_after_softmax_shares_its_quantizer_and_onnxruntime_equals_eager(
        capture: str, cast: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(4, 6, 6) * 3, torch.randn(4, 6, 8)) for _ in range(3)]
    prepared = co.prepare(_EagerAttention(cast).eval(), co.QuantizerConfig.presets.w8a8(), data[0], capture=capture)
    casts = [n for n in prepared.graph.nodes if str(n.target) in ("to", "type_as")
             or str(n.target).startswith(("aten.to", "aten.type_as"))]
    assert casts and all(get_meta(n).kind is OpKind.MOVE for n in casts)
    served = [get_meta(n).quantizer.serves for n in prepared.graph.nodes if get_meta(n).quantizer is not None]
    # no quantizer of the cast's own (it was calibrated to [0, 1] behind softmax's [0, 255/256])
    assert not any(s.startswith(("to", "type_as")) for s in served)
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, data[0], tmp_path / "attention.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    with torch.no_grad():
        for batch in data:
            got = session.run(None, dict(zip(names, (t.numpy() for t in batch), strict=True)))[0]
            # measured with the cast's own quantizer: 13 of 192 outputs differed (onnxruntime merged the pairs)
            np.testing.assert_allclose(got, converted(*batch).numpy(), rtol=0, atol=1e-6)
    report = co.verify_onnx(converted, path, data)
    assert report.ok, report


class _TensorSplit(nn.Module):
    """Mamba's mixer: ``torch.tensor_split`` of a quantized projection into pieces each product reads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = torch.tensor_split(self.proj(x), 3, dim=-1)
        return (a * b) @ c.transpose(-1, -2)


def test_tensor_split_pieces_share_the_projections_quantizer_and_onnxruntime_equals_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(4, 5, 8),) for _ in range(3)]
    prepared = co.prepare(_TensorSplit().eval(), co.QuantizerConfig.presets.w8a8(), data[0], capture="export")
    splits = [n for n in prepared.graph.nodes if "tensor_split" in str(n.target)]
    assert splits and all(get_meta(n).kind is OpKind.MOVE for n in splits)
    served = [get_meta(n).quantizer.serves for n in prepared.graph.nodes if get_meta(n).quantizer is not None]
    assert not any(s.startswith("getitem") for s in served)  # the pieces read the projection's grid
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, data[0], tmp_path / "split.onnx")
    report = co.verify_onnx(converted, path, data)
    assert report.ok, report
