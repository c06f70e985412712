"""The torch.export fallback must not silently specialise a dimension we asked to be dynamic.

Measured before the fix: a model branching on ``x.shape[0] == 1`` was captured at batch 8 and batch 1 silently ran
the batch-8 branch (relative error 0.74). Now prepare refuses such a model with a ShapeGuardError naming the input,
the dimension, the condition, the source line and the fixes; declaring the size fixed (``dynamic_shapes``) gives a
model that is exact at that size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.graph.capture_error import ShapeGuardError
from coreai_opt.passes import CaptureError

W8A8 = co.QuantizerConfig.presets.w8a8


class BatchOneBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.fc(x) * 2.0
        return self.fc(x)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            return self.fc(x) - 1.0
        return self.fc(x)


class SizeGeneric(nn.Module):
    """Control flow FX cannot trace (so export is used), but nothing that depends on the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.mean(1)
        return self.fc(x.reshape(x.shape[0], -1))


def test_a_branch_on_the_batch_size_is_refused_naming_input_dimension_condition_line_and_fixes() -> None:
    with pytest.raises(ShapeGuardError) as info:
        co.prepare(BatchOneBranch().eval(), W8A8(), (torch.randn(8, 4),))
    message = str(info.value)
    assert "BatchOneBranch.forward branches on dimension 0 of input 'x'" in message
    assert "test_shape_guards.py:" in message and "(if x.shape[0] == 1:)" in message
    assert "only the branch taken when x.size(0) != 1 (the example has x.size(0) = 8)" in message
    assert "torch.where" in message and "dynamic_shapes={'x': None}" in message and "dynamic_batch=False" in message
    assert isinstance(info.value, CaptureError) and isinstance(info.value, ValueError)


def test_a_branch_that_fixes_the_batch_size_is_refused() -> None:
    with pytest.raises(ShapeGuardError, match=r"dimension 0 of input 'x' was exported as dynamic, but "
                                              r"FixedBatch\.forward fixes it to 8 at .*test_shape_guards\.py:\d+ "
                                              r"\(if x\.shape\[0\] == 8:\).*dynamic_shapes=\{'x': None\}"):
        co.prepare(FixedBatch().eval(), W8A8(), (torch.randn(8, 4),))


def test_declaring_the_batch_fixed_gives_an_exact_model_at_that_size() -> None:
    torch.manual_seed(0)
    model = BatchOneBranch().eval()
    for batch in (1, 8):
        x = torch.randn(batch, 4)
        prepared = co.prepare(model, W8A8(), (x,), dynamic_shapes={"x": None})
        co.enable_fake_quant(prepared, False)
        with torch.no_grad():
            assert torch.equal(prepared(x), model(x))  # batch 1 takes the * 2 branch, batch 8 the other


def test_a_size_generic_model_exported_at_batch_2_is_exact_at_batch_1_and_8() -> None:
    torch.manual_seed(0)
    model = SizeGeneric().eval()
    prepared = co.prepare(model, W8A8(), (torch.randn(2, 3, 4),))
    assert prepared.meta["coreai_opt"]["capture"] == "export"
    co.enable_fake_quant(prepared, False)
    with torch.no_grad():
        for batch in (1, 8):
            x = torch.randn(batch, 3, 4)
            assert torch.equal(prepared(x), model(x))


def test_torch_internal_size_checks_are_not_refused() -> None:
    """``nn.TransformerEncoder`` guards ``batch != 1`` inside torch's own ops; they compute the same for batch 1.

    (Within float rounding: eager inference takes PyTorch's fused fast path, the graph the decomposed ops.)
    """
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    prepared = co.prepare(model, W8A8(), (torch.randn(2, 5, 16),), capture="export")
    co.enable_fake_quant(prepared, False)
    with torch.no_grad():
        for batch in (1, 6):
            x = torch.randn(batch, 5, 16)
            assert torch.allclose(prepared(x), model(x), atol=1e-5, rtol=0)


def test_a_batch_of_one_example_warns_that_the_batch_is_fixed() -> None:
    with pytest.warns(UserWarning, match=r"every example input has batch 1; .* give an example batch of at least 2"):
        co.prepare(SizeGeneric().eval(), W8A8(), (torch.randn(1, 3, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        co.prepare(SizeGeneric().eval(), W8A8(), (torch.randn(1, 3, 4),), dynamic_shapes={"x": None})


def test_dynamic_shapes_must_name_forward_arguments() -> None:
    with pytest.raises(ValueError, match=r"dynamic_shapes names \['y'\], which are not arguments of "
                                         r"SizeGeneric\.forward \(its arguments: \['x'\]\)"):
        co.prepare(SizeGeneric().eval(), W8A8(), (torch.randn(2, 3, 4),), dynamic_shapes={"y": None})
    with pytest.raises(TypeError, match=r"dynamic_shapes must be a dict keyed by forward argument name"):
        co.prepare(SizeGeneric().eval(), W8A8(), (torch.randn(2, 3, 4),), dynamic_shapes=[None])
