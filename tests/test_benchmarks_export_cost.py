"""The export-cost study (issue 29): the float export it divides by makes the same axes dynamic as our file."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import coreai_opt as co
from benchmarks.common.onnx_utils import same_axes
from benchmarks.export_cost.run import write_table


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 8), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * mask.unsqueeze(-1))


def test_same_axes_names_every_dimension_our_file_keeps_symbolic_and_shares_equal_names(tmp_path: Path) -> None:
    ids, mask = torch.randint(0, 50, (2, 6)), torch.ones(2, 6)
    prepared = co.prepare(_Tokens().eval(), co.QuantizerConfig.presets.w8a8(), (ids, mask))
    co.calibrate(prepared, [(ids, mask)], progress=False)
    path = co.export_onnx(co.convert(prepared), (ids, mask), tmp_path / "m.onnx", input_names=["ids", "mask"],
                          dynamic_shapes={"ids": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 1: "sequence"}})
    first, second = same_axes(path)
    assert {i: d.__name__ for i, d in first.items()} == {0: "batch", 1: "sequence"}
    assert first[0] is second[0] and first[1] is second[1]  # one Dim per name: the float export ties them too


def test_the_page_states_median_worst_and_the_goal(tmp_path: Path) -> None:
    rows = {"a": {"name": "a", "seconds": {"float": [2.0, 2.0], "ours": [2.8, 3.2]}, "ratio": 1.5,
                  "spread": [1.4, 1.6]},
            "b": {"name": "b", "failed": "RuntimeError: boom"}}
    write_table(rows, tmp_path / "R.md")
    page = (tmp_path / "R.md").read_text()
    assert "**1 models: ratio median 1.50, worst 1.50 (goal <= 1.5: met)**" in page
    assert "| a | 2.0 | 3.0 | 1.50 (1.40–1.60) |" in page and "| b | - | - | RuntimeError: boom |" in page
