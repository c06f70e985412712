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
