"""fold_channel_scales: a layer scale ``y * gamma`` after a conv / linear is folded into its weights, exactly."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.onnx.verify.fusion_report import optimized_model

W8A8 = QuantizerConfig.presets.w8a8


class _ConvLayerScale(nn.Module):
    """timm ConvNeXt's ``conv_mlp`` block tail: ``x + drop(fc2(act(fc1(x)))).mul(gamma.reshape(1, -1, 1, 1))``."""

    def __init__(self, gamma_shape: tuple[int, ...] = (8,), drop: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(8, 16, 1), nn.Conv2d(16, 8, 1)
        self.drop = drop if drop is not None else nn.Identity()  # timm's Mlp.drop2: identity in eval
        self.gamma = nn.Parameter(torch.linspace(-0.5, 2.0, 8).reshape(gamma_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.fc2(torch.relu(self.fc1(x))))
        return x + y.mul(self.gamma.reshape(1, -1, 1, 1) if self.gamma.dim() == 1 else self.gamma)


class _LinearLayerScale(nn.Module):
    """CaiT / DeiT-III: ``x + gamma * proj(x)`` on ``[batch, tokens, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.linspace(0.1, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.proj(x)


def _muls(prepared: torch.fx.GraphModule) -> int:
    return sum(get_meta(n).kind is OpKind.MUL for n in prepared.graph.nodes)


@pytest.mark.parametrize(("model", "x"), [(_ConvLayerScale(), torch.randn(2, 8, 5, 5)),
                                          (_ConvLayerScale(drop=nn.Dropout(0.1)), torch.randn(2, 8, 5, 5)),
                                          (_LinearLayerScale(), torch.randn(2, 6, 8))])
def test_a_layer_scale_is_folded_into_the_weights_and_the_float_model_is_unchanged(model: nn.Module,
                                                                                  x: torch.Tensor) -> None:
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = QuantizerConfig(weight=None, activation=None)  # float: the folded graph alone
    with pytest.warns(UserWarning, match="quantizes nothing"):
        prepared = co.prepare(model, config, (x,))
    assert _muls(prepared) == 0
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the user's model untouched
    with pytest.warns(UserWarning, match="quantizes nothing"):
        kept = co.prepare(model, config.model_copy(update={"fold_channel_scales": False}), (x,))
    assert _muls(kept) == 1


def test_a_scale_that_varies_along_another_axis_or_a_qat_model_keeps_the_multiply() -> None:
    spatial = _ConvLayerScale(gamma_shape=(1, 1, 1, 8)).eval()  # broadcasts along the width, not the channels
    x = torch.randn(2, 8, 5, 8)
    assert _muls(co.prepare(spatial, W8A8(), (x,))) == 1
    assert _muls(co.prepare(_ConvLayerScale().train(), W8A8(), (torch.randn(2, 8, 5, 5),), qat=True)) == 1


def test_folded_layer_scale_runs_without_qlinear_mul_and_onnxruntime_matches_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(2, 8, 5, 5),) for _ in range(3)]
    model = _ConvLayerScale().eval()
    counts = {}
    for fold in (True, False):
        config = W8A8().model_copy(update={"fold_channel_scales": fold})
        prepared = co.prepare(model, config, batches[0])
        co.calibrate(prepared, batches, progress=False)
        converted = co.convert(prepared)
        path = co.export_onnx(converted, batches[0], tmp_path / f"fold_{fold}.onnx")
        ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
        counts[fold] = {op: ops[op] for op in ("QLinearConv", "QLinearMul", "QLinearAdd")}
        assert co.verify_onnx(converted, path, batches).ok
    assert counts == {True: {"QLinearConv": 2, "QLinearMul": 0, "QLinearAdd": 1},
                      False: {"QLinearConv": 2, "QLinearMul": 1, "QLinearAdd": 1}}
