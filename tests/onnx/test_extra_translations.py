"""Translations torch's exporter lacks (coreai_opt.onnx.export.extra_translations), exact against eager."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from coreai_opt.onnx.export.extra_translations import extra_translation_table

pytest.importorskip("transformers.integrations.moe")  # registers torch.ops.transformers.grouped_mm_fallback


class _GroupedExperts(nn.Module):
    """transformers' grouped experts step: rows sorted by expert, one weight per expert, cumulative row offsets."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, 8, 5))

    def forward(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(rows, self.weight, offs)


def _run(model: nn.Module, inputs: tuple[torch.Tensor, ...], path: str) -> list[np.ndarray]:
    program = torch.onnx.export(model, inputs, dynamo=True, opset_version=18, verbose=False,
                                custom_translation_table=extra_translation_table(18))
    program.save(path)
    session = ort.InferenceSession(path)
    return session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})


@pytest.mark.parametrize("offs", [[2, 2, 7, 9], [0, 10, 10, 10], [3, 5, 8, 10]],
                         ids=["an-empty-expert-and-a-tail-row", "one-expert-takes-all", "every-row-routed"])
def test_grouped_mm_fallback_runs_in_onnxruntime_as_eager_computes_it(offs, tmp_path):
    torch.manual_seed(0)
    model, rows = _GroupedExperts().eval(), torch.randn(10, 8)
    offsets = torch.tensor(offs, dtype=torch.int32)
    expected = model(rows, offsets).detach().numpy()
    (got,) = _run(model, (rows, offsets), str(tmp_path / "grouped.onnx"))
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    assert (got[offs[-1]:] == 0).all()  # rows of no expert are zero, as the fallback leaves them


def test_a_stable_sort_exports_as_onnxruntime_topk_with_the_same_tied_order(tmp_path):
    class Sort(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sort(x, dim=0, descending=True, stable=True)

    x = torch.randint(0, 3, (50, 3), generator=torch.Generator().manual_seed(0)).float()
    values, indices = _run(Sort(), (x,), str(tmp_path / "sort.onnx"))
    expected = torch.sort(x, dim=0, descending=True, stable=True)
    np.testing.assert_array_equal(values, expected.values.numpy())
    np.testing.assert_array_equal(indices, expected.indices.numpy())



def test_erfinv_runs_in_onnxruntime_within_a_few_float32_ulps_of_torch(tmp_path):
    class Quantile(nn.Module):
        def forward(self, p: torch.Tensor) -> torch.Tensor:
            return torch.distributions.normal.Normal(0, 1).icdf(p)  # sqrt(2) · erfinv(2p - 1): hf Gemma-3n

    p = torch.cat([torch.linspace(1e-6, 1 - 1e-6, 4001), torch.tensor([0.5, 0.95, 1e-7, 1 - 1e-7])])
    (got,) = _run(Quantile(), (p,), str(tmp_path / "icdf.onnx"))
    expected = Quantile()(p).numpy()
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)
    (edges,) = _run(Quantile(), (torch.tensor([0.0, 1.0]),), str(tmp_path / "edges.onnx"))
    assert edges.tolist() == [-np.inf, np.inf]
