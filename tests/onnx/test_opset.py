from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from coreai_opt.onnx.export.opset import GELU_OPSET, MAX_OPSET, MIN_OPSET, QuantizerUse, preferred_opset, select_opset


@pytest.mark.parametrize(
    ("uses", "expected"),
    [
        ([], 18),
        ([QuantizerUse("int8", False), QuantizerUse("uint8", False), QuantizerUse("int32", False)], 18),
        ([QuantizerUse("uint8", False), QuantizerUse("float8_e4m3fn", False)], 19),
        ([QuantizerUse("float8_e5m2", False)], 19),
        ([QuantizerUse("int8", False), QuantizerUse("uint16", False)], 21),
        ([QuantizerUse("int16", False)], 21),
        ([QuantizerUse("int4", False)], 21),
        ([QuantizerUse("uint4", False)], 21),
        ([QuantizerUse("int8", True)], 21),
        ([QuantizerUse("float8_e4m3fn", True)], 21),
    ],
)
def test_select_opset_picks_lowest_opset_the_dtypes_allow(uses: list[QuantizerUse], expected: int) -> None:
    assert select_opset(uses) == expected


def test_select_opset_keeps_an_explicit_opset_that_is_high_enough() -> None:
    assert select_opset([QuantizerUse("int8", False)], 21) == 21
    assert select_opset([QuantizerUse("float8_e4m3fn", False)], 19) == 19


@pytest.mark.parametrize(
    ("use", "opset", "needed"),
    [
        (QuantizerUse("int4", False, "fc.weight"), 20, 21),
        (QuantizerUse("float8_e4m3fn", False, "x"), 18, 19),
        (QuantizerUse("uint16", False, "act"), 19, 21),
        (QuantizerUse("int8", True, "blocked"), 20, 21),
    ],
)
def test_select_opset_names_dtype_and_minimum_when_explicit_opset_is_too_low(
    use: QuantizerUse, opset: int, needed: int
) -> None:
    message = rf"opset={opset} is too low for quantizer '{use.name}'.*{use.dtype}.*>= {needed}"
    with pytest.raises(ValueError, match=message):
        select_opset([QuantizerUse("int8", False), use], opset)


@pytest.mark.parametrize("opset", [MIN_OPSET - 1, 13, MAX_OPSET + 1])
def test_select_opset_rejects_opsets_outside_supported_range(opset: int) -> None:
    with pytest.raises(ValueError, match=rf"opsets {MIN_OPSET}\.\.{MAX_OPSET}"):
        select_opset([QuantizerUse("int8", False)], opset)


def test_select_opset_rejects_non_int_opset() -> None:
    with pytest.raises(TypeError, match="opset must be an int"):
        select_opset([], "21")  # type: ignore[arg-type]


def test_select_opset_refuses_dtype_without_onnxruntime_kernel() -> None:
    with pytest.raises(ValueError, match="'float4_e2m1'.*no onnxruntime.*kernel.*int8"):
        select_opset([QuantizerUse("float4_e2m1", False, "w")])


def test_a_gelu_raises_the_default_opset_to_20_but_an_explicit_lower_opset_still_exports() -> None:
    assert preferred_opset(nn.Sequential(nn.Linear(4, 4), nn.GELU())) == GELU_OPSET == 20
    traced = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    assert preferred_opset(traced) == 20
    functional = fx.symbolic_trace(_FunctionalGelu())
    assert preferred_opset(functional) == 20
    assert preferred_opset(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == MIN_OPSET
    int8 = [QuantizerUse("int8", False)]
    assert select_opset(int8, preferred=20) == 20
    assert select_opset([QuantizerUse("int16", False)], preferred=20) == 21  # dtypes can ask for more
    assert select_opset(int8, 18, preferred=20) == 18  # an explicit opset is never refused for an op


class _FunctionalGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate="tanh")
