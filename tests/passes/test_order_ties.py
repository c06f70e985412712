"""sort / argsort / topk break ties by index (coreai_opt.passes.order_ties), as onnxruntime's TopK does."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.passes.capture import capture
from coreai_opt.passes.order_ties import order_ties


class _TiedSelections(nn.Module):
    """topk, sort and argsort of a tensor full of ties; every index output is returned (and a quantized head)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(40, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        top = torch.topk(x, 3, dim=-1).indices
        low = x.topk(2, largest=False).indices
        ranks = torch.sort(x, dim=-1, descending=True)[1]
        order = x.argsort(dim=-1)
        return top, low, ranks, order, self.head(x)


def _ties(seed: int) -> torch.Tensor:
    return torch.randint(0, 3, (16, 40), generator=torch.Generator().manual_seed(seed)).float()


def test_every_sort_and_topk_node_is_rewritten_to_index_order_on_the_fx_and_the_export_capture():
    x = _ties(0)
    for method in ("fx", "export"):
        gm = capture(_TiedSelections(), (x,), method=method)
        assert order_ties(gm).changes == 4
        top, low, ranks, order, _ = gm(x)
        stable_up = torch.sort(x, dim=-1, stable=True).indices
        stable_down = torch.sort(x, dim=-1, descending=True, stable=True).indices
        assert torch.equal(top, stable_down[:, :3]) and torch.equal(ranks, stable_down)
        assert torch.equal(low, stable_up[:, :2]) and torch.equal(order, stable_up)


def test_torch_kernels_order_these_ties_differently_so_the_rewrite_changes_eager():
    """The premise: without the pass, eager's tied order is not onnxruntime's (else the pass would be moot)."""
    x = _ties(0)
    plain = _TiedSelections()(x)
    stable_down = torch.sort(x, dim=-1, descending=True, stable=True).indices
    assert not torch.equal(plain[0], stable_down[:, :3])
    assert not torch.equal(plain[2], stable_down)


def test_the_exported_file_picks_exactly_the_tied_indices_eager_picks(tmp_path):
    x = _ties(1)
    prepared = co.prepare(_TiedSelections().eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (x,), tmp_path / "ties.onnx")
    session = ort.InferenceSession(str(path))
    for seed in (2, 3, 4):
        probe = _ties(seed)
        onnx_out = session.run(None, {session.get_inputs()[0].name: probe.numpy()})
        for eager, file_out in zip(converted(probe)[:4], onnx_out[:4], strict=True):
            np.testing.assert_array_equal(eager.numpy(), file_out)


class _SortedRouting(nn.Module):
    """Rows grouped by a tied key (a mixture of experts' sort by expert id), transformed, then put back in order."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.proj = nn.Linear(16, 4), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.router(x).argmax(dim=-1)
        _, perm = torch.sort(expert)
        grouped = self.proj(x[perm])
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return grouped[inverse]


def test_a_model_that_reads_rows_in_sorted_order_verifies_with_every_quantizer_code_identical(tmp_path):
    torch.manual_seed(0)
    batches = [(torch.randn(64, 16),) for _ in range(3)]
    prepared = co.prepare(_SortedRouting().eval(), co.QuantizerConfig.presets.w8a8(), batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, batches[0], tmp_path / "routing.onnx", dynamic_batch=False)
    report = co.verify_onnx(converted, path, batches)
    assert report.ok, report
    gathered = [q for q in report.quantizers if q.count == 64 * 16]
    assert gathered and all(q.identical == 1.0 for q in gathered), gathered
