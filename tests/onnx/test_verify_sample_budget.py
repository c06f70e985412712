"""verify_onnx holds a bounded volume of quantizer outputs: the code comparison runs on the leading samples that fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.onnx.verify import sample_budget
from coreai_opt.onnx.verify.sample_budget import (
    ActivationBytes,
    leading_rows,
    leading_samples,
    samples_within_budget,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    data = [torch.randn(8, 64) for _ in range(2)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],))
    co.calibrate(prepared, data, progress=False)
    model = co.convert(prepared)
    path = co.export_onnx(model, (data[0],), tmp_path_factory.mktemp("budget") / "mlp.onnx")
    return model, path, data


def test_samples_within_budget_counts_each_samples_activation_quantizer_bytes(converted) -> None:
    model, _, data = converted
    with ActivationBytes(model) as counted, torch.no_grad():
        model(data[0])
    # per sample: the input (64), the first linear's output after the fused ReLU (32), the returned output (16),
    # float32: 448 bytes; weights do not count (their quantizers' outputs do not grow with the batch)
    assert counted.bytes == 8 * 448
    assert samples_within_budget(model, (data[0],), counted.bytes, budget=448 * 3) == 3
    assert samples_within_budget(model, (data[0],), counted.bytes, budget=448 * 3 - 1) == 2
    assert samples_within_budget(model, (data[0],), counted.bytes, budget=10) == 1  # at least one sample
    assert samples_within_budget(model, (data[0],), counted.bytes) == 8  # the default 1 GiB holds the whole batch


class _StaticBatch(nn.Module):
    """A model that takes its example batch only (a reshape to a literal size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(8, 64).sum(-1)


def test_a_model_that_refuses_a_smaller_batch_is_compared_on_the_whole_batch() -> None:
    x = torch.randn(8, 64)
    assert samples_within_budget(_StaticBatch(), (x,), batch_bytes=10**9, budget=100) == 8


def test_leading_samples_cut_only_tensors_of_the_batchs_size() -> None:
    x, table = torch.arange(12.0).reshape(4, 3), torch.zeros(1, 3)
    head = leading_samples((x, table), 2)
    assert torch.equal(head[0], x[:2]) and head[1] is table
    assert leading_rows(x.numpy(), 2, 4).shape == (2, 3) and leading_rows(table.numpy(), 2, 4).shape == (1, 3)


def test_verify_compares_quantizers_on_the_samples_within_budget_and_outputs_on_all(
        converted, monkeypatch: pytest.MonkeyPatch) -> None:
    model, path, data = converted
    full = co.verify_onnx(model, path, data)
    monkeypatch.setattr(sample_budget, "CODES_BUDGET_BYTES", 448 * 3)
    bounded = co.verify_onnx(model, path, data)
    assert (full.quantizer_samples, bounded.quantizer_samples) == (8, 3)
    assert bounded.num_samples == full.num_samples == 16 and bounded.ok and full.ok
    assert [q.count for q in bounded.quantizers] == [3 * 64, 3 * 32, 3 * 16]  # codes compared per quantizer
    assert [q.count for q in full.quantizers] == [8 * 64, 8 * 32, 8 * 16]
    assert "compared on 3 sample(s) of the first batch" in str(bounded)
