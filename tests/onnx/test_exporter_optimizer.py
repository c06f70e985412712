"""export_onnx runs torch's optimizer without its quadratic SlicesSplit rule (onnx/export/exporter_optimizer.py)."""

from __future__ import annotations

import contextlib

import onnx
import torch
from onnxscript import rewriter
from torch import nn

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as export_onnx_module
from coreai_opt.onnx.export.exporter_optimizer import QUADRATIC_REWRITES, without_quadratic_rewrites


def _names(rules: tuple) -> set[str]:
    return {str(getattr(rule, "name", None)) for rule in rules}


def test_the_rule_is_left_out_only_inside_the_block_and_onnxscript_still_names_it():
    """If onnxscript renames the rule, the first assert fails: the set would silently stop leaving it out."""
    defaults = rewriter._DEFAULT_REWRITE_RULES
    assert QUADRATIC_REWRITES <= _names(defaults)
    with without_quadratic_rewrites() as left_out:
        assert left_out == ("SlicesSplit",)
        assert not QUADRATIC_REWRITES & _names(rewriter._DEFAULT_REWRITE_RULES)
        assert len(rewriter._DEFAULT_REWRITE_RULES) == len(defaults) - 1
    assert rewriter._DEFAULT_REWRITE_RULES is defaults


class _TwoHalves(nn.Module):
    """Two slices of one tensor along its last axis, [0, 8) and [8, 16): the SlicesSplit pattern."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.out = nn.Linear(16, 16), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.out(h[..., 0:8] * torch.sigmoid(h[..., 8:16]))


def test_leaving_the_rule_out_writes_the_same_file_it_never_matches_torch_s_five_input_slices(tmp_path,
                                                                                           monkeypatch):
    """torch writes every Slice with its steps input; the rule's pattern has four inputs, so it rewrites nothing."""
    x = [(torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)),) for seed in range(4)]
    prepared = co.prepare(_TwoHalves().eval(), co.QuantizerConfig.presets.w8a8(), x[0])
    co.calibrate(prepared, x, progress=False)
    converted = co.convert(prepared)
    without = co.export_onnx(converted, x[0], tmp_path / "without.onnx")
    monkeypatch.setattr(export_onnx_module, "without_quadratic_rewrites", lambda: contextlib.nullcontext(()))
    with_rule = co.export_onnx(converted, x[0], tmp_path / "with.onnx")
    graphs = [onnx.load(str(path)).graph for path in (without, with_rule)]
    nodes = [[(n.op_type, list(n.input), list(n.output)) for n in graph.node] for graph in graphs]
    assert nodes[0] == nodes[1]
    assert [n.op_type for n in graphs[0].node].count("Slice") == 2
    assert all(len(n.input) == 5 for n in graphs[0].node if n.op_type == "Slice")
    assert co.verify_onnx(converted, without, [x[3]]).ok
