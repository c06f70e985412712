"""Calibration through a boolean-mask selection that is empty for some batches (issue 30, class 1).

The graph of an encoder-decoder sequence classifier in miniature: ``head(hidden[eos_mask])``. A batch whose mask
selects nothing gives the head an empty tensor; it must change no statistic, and a quantizer that only ever saw
empty tensors is reported at convert like any never-calibrated quantizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coreai_opt.api import calibrate, convert, prepare
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig


class _MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        return self.head(hidden[mask])


def _batches() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    some = torch.zeros(2, 5, dtype=torch.bool)
    some[0, 1] = some[1, 4] = True
    non_empty = [(torch.randn(2, 5, 8, generator=gen), some) for _ in range(3)]
    empty = (torch.randn(2, 5, 8, generator=gen) * 50, torch.zeros(2, 5, dtype=torch.bool))
    return non_empty, [non_empty[0], empty, non_empty[1], empty, non_empty[2]]


@pytest.mark.parametrize("activation_range", ["minmax", "moving_average", "percentile", "entropy"])
def test_empty_selection_batches_leave_the_selection_quantizer_bit_identical(activation_range: str) -> None:
    torch.manual_seed(0)
    model = _MaskedHead().eval()
    non_empty, mixed = _batches()
    config = QuantizerConfig.presets.w8a8(activation_range=activation_range)
    results = []
    for batches in (non_empty, mixed):
        prepared = prepare(model, config, non_empty[0])
        calibrate(prepared, batches, progress=False)
        converted = convert(prepared)
        results.append({name: fq.get_qparams() for name, fq in fake_quantizers(converted)})
    only, with_empty = results
    assert only.keys() == with_empty.keys() == {"x_input_fq", "body_weight_fq", "body_output_fq",
                                                "head_weight_fq", "head_output_fq"}
    for a, b in zip(only["head_output_fq"], with_empty["head_output_fq"], strict=True):  # sees only the selection
        assert torch.equal(a, b)
    assert not torch.equal(only["body_output_fq"].scale, with_empty["body_output_fq"].scale)  # the batches ran


def test_quantizer_that_saw_only_empty_selections_is_reported_as_never_calibrated() -> None:
    model = _MaskedHead().eval()
    non_empty, mixed = _batches()
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), non_empty[0])
    calibrate(prepared, [mixed[1], mixed[3]], progress=False)
    with pytest.raises(ValueError, match=r"1 activation quantizer\(s\) were never calibrated: head\.output; .*empty"):
        convert(prepared)


class _EmptyCachePrefix(nn.Module):
    """``cat([x.new_zeros(b, 0, d), proj(x)], 1)``: an empty cache prefix (hf inkling2, deepseek_v4's compressor)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(x)
        prefix = hidden.new_zeros(hidden.shape[0], 0, hidden.shape[2])
        return self.out(torch.cat([prefix, hidden], dim=1) * 2.0)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_tensor_empty_for_every_input_gets_no_quantizer_and_the_model_exports_and_verifies(capture, tmp_path):
    from coreai_opt.onnx import export_onnx, verify_onnx

    model = _EmptyCachePrefix().eval()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 5, 8, generator=gen) for _ in range(3)]
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), (batches[0],), capture=capture)
    names = {name for name, _ in fake_quantizers(prepared)}
    assert not any("new_zeros" in name for name in names), names  # before: a quantizer that never saw a value
    calibrate(prepared, batches, progress=False)
    converted = convert(prepared)  # before: "1 activation quantizer(s) were never calibrated: ...new_zeros"
    path = export_onnx(converted, (batches[0],), tmp_path / "m.onnx")
    report = verify_onnx(converted, path, [(b,) for b in batches])
    assert report.ok, report
    with torch.no_grad():
        assert torch.equal(converted(batches[1]), converted(batches[1]))
