"""Decomposing only the nodes that need it gives torch's whole-graph decomposition's file, node for node.

``export_onnx`` splices the decomposition of each node torchlib cannot translate (or torch lowers: views, aliases)
into the captured program instead of re-tracing the whole program (``onnx/export/local_decompositions.py``). The
tests export the same converted model both ways and compare the files structurally (every node's op, attributes
and wiring; initializers by content) and onnxruntime's outputs bit for bit; a program the local route cannot
handle goes to torch's decomposition unchanged.
"""

import contextlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.onnx._internal.exporter import _fx_passes

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as export_module
from coreai_opt.onnx.export.local_decompositions import decompose_locally
from tests.onnx.canonical_graph import canonical_graph


class _PoolMaskNet(nn.Module):
    """Every kind of node the local route decomposes: a table op (``adaptive_avg_pool2d``, ``__and__``) and ops
    torch lowers whatever the table says (``flatten``, ``reshape``, ``to.dtype``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        keep = (h > 0.1) & (h < 2.0)
        h = h * keep.to(h.dtype)
        pooled = nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.fc(pooled).reshape(x.shape[0], 2, 2)


class _Counted:
    """torch's whole-graph decomposition, counting its calls."""

    def __init__(self) -> None:
        self.whole_graph = _fx_passes.decompose_with_registry
        self.calls = 0

    def __call__(self, program, registry):
        self.calls += 1
        return self.whole_graph(program, registry)


def _both_ways(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], tmp_path, monkeypatch,
               input_names: list[str] | None = None) -> tuple[onnx.ModelProto, onnx.ModelProto, int]:
    prepared = co.prepare(model.eval(), co.QuantizerConfig.presets.w8a8(), batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    counted = _Counted()
    monkeypatch.setattr(_fx_passes, "decompose_with_registry", counted)
    co.export_onnx(converted, batches[0], tmp_path / "local.onnx", input_names=input_names)
    local_calls = counted.calls
    monkeypatch.setattr(export_module, "decompositions_local", contextlib.nullcontext)
    co.export_onnx(converted, batches[0], tmp_path / "whole.onnx", input_names=input_names)
    assert counted.calls == local_calls + 1
    return onnx.load(tmp_path / "local.onnx"), onnx.load(tmp_path / "whole.onnx"), local_calls


def _outputs(path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_local_route_gives_the_whole_graph_decompositions_file_for_pool_mask_and_views(tmp_path, monkeypatch):
    torch.manual_seed(0)
    batches = [(torch.randn(2, 3, 12, 12),) for _ in range(3)]
    local, whole, whole_graph_calls = _both_ways(_PoolMaskNet(), batches, tmp_path, monkeypatch)
    assert whole_graph_calls == 0  # the local route ran: torch's whole-graph pass was never called
    assert canonical_graph(local) == canonical_graph(whole)
    feeds = {"x": torch.randn(5, 3, 12, 12).numpy()}  # another batch: the axis stayed symbolic
    for ours, torchs in zip(_outputs(tmp_path / "local.onnx", feeds), _outputs(tmp_path / "whole.onnx", feeds),
                            strict=True):
        np.testing.assert_array_equal(ours, torchs)


def test_local_route_gives_the_whole_graph_decompositions_file_for_hf_bert(tmp_path, monkeypatch):
    """BERT's attention masks (``__and__``, ``__or__``, ``to.device``, ``to.dtype``) and its reshapes."""
    from benchmarks.corpus.models import corpus_entry

    entry = corpus_entry("hf-bert")
    torch.manual_seed(0)
    batches = [entry.inputs(torch.Generator().manual_seed(s), 2) for s in range(2)]
    local, whole, whole_graph_calls = _both_ways(entry.build(), batches, tmp_path, monkeypatch,
                                                 list(entry.input_names))
    assert whole_graph_calls == 0
    assert canonical_graph(local) == canonical_graph(whole)
    feeds = {name: np.asarray(t) for name, t in zip(entry.input_names, batches[1], strict=True)}
    for ours, torchs in zip(_outputs(tmp_path / "local.onnx", feeds), _outputs(tmp_path / "whole.onnx", feeds),
                            strict=True):
        np.testing.assert_array_equal(ours, torchs)


class _Branches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,)).flatten(1)


def _registry():
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    return ONNXRegistry.from_torchlib()


class _Identity(nn.Module):
    """``torch.eye(n)``: an op with no tensor input, which make_fx traces in a fake mode of its own (hf Qwen3.5)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.eye(x.shape[-1]) + x


@pytest.mark.parametrize("model, example", [
    (_Branches(), (torch.randn(2, 3, 4),)),  # a higher-order op: its subgraphs are not walked
    (_Identity(), (torch.randn(2, 3, 4),)),  # the spliced values would belong to another fake mode
])
def test_a_program_the_local_route_cannot_handle_goes_to_torchs_decomposition_untouched(model, example):
    program = torch.export.export(model, example, strict=False)
    before = program.graph_module.code
    handed = []

    def whole_graph(given, registry):
        handed.append(given)
        return given

    assert decompose_locally(program, _registry(), whole_graph) is program
    assert handed == [program]
    assert program.graph_module.code == before


def test_decompose_locally_splices_the_decomposition_in_place_of_the_node():
    class PoolFlatten(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.adaptive_avg_pool2d(x, 1).flatten(1) * 2

    program = torch.export.export(PoolFlatten(), (torch.randn(2, 3, 4, 4),), strict=False)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"aten.adaptive_avg_pool2d.default", "aten.flatten.using_ints"} <= ops
    expected = program.module()(torch.arange(96.0).reshape(2, 3, 4, 4))

    def whole_graph(given, registry):
        raise AssertionError("the local route applies to this program")

    decomposed = decompose_locally(program, _registry(), whole_graph)
    ops = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert "aten.adaptive_avg_pool2d.default" not in ops and "aten.flatten.using_ints" not in ops
    assert torch.equal(decomposed.module()(torch.arange(96.0).reshape(2, 3, 4, 4)), expected)


class _TokenPool(nn.Module):
    """Swin's head: tokens pooled over the sequence (``adaptive_avg_pool1d`` of a transposed view)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.adaptive_avg_pool1d(self.norm(x).transpose(1, 2), 1).flatten(1)
        return self.fc(pooled)


def test_a_restride_that_keeps_every_element_in_place_is_dropped_with_the_same_outputs(tmp_path, monkeypatch):
    """``adaptive_avg_pool1d`` decomposes to ``mean`` then ``as_strided_`` (the input's memory format, same shape,
    strides equal wherever the size is not 1): no translation exists for it, and it moves no element."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 49, 8),) for _ in range(3)]
    local, whole, whole_graph_calls = _both_ways(_TokenPool(), batches, tmp_path, monkeypatch)
    assert whole_graph_calls == 0
    assert len(local.graph.node) <= len(whole.graph.node)  # torch writes the restride as shape arithmetic
    feeds = {"x": torch.randn(5, 49, 8).numpy()}
    for ours, torchs in zip(_outputs(tmp_path / "local.onnx", feeds), _outputs(tmp_path / "whole.onnx", feeds),
                            strict=True):
        np.testing.assert_array_equal(ours, torchs)
