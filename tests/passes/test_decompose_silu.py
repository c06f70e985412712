"""SiLU becomes x · sigmoid(x) (coreai_opt.passes.decompose_silu): onnxruntime runs QLinearSigmoid + QLinearMul."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coreai_opt as co
from coreai_opt.config import OpConfig, QuantizerConfig
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.passes.capture import capture
from coreai_opt.passes.decompose_silu import decompose_silu

W8A8 = QuantizerConfig.presets.w8a8


class _ConvSiLU(nn.Module):
    """conv → SiLU → conv (efficientnet's and MobileViT's conv blocks), as a module or as ``F.silu``."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.a, self.act, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(inplace=True), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(F.silu(h) if self.functional else self.act(h))


def _ort_ops(model: nn.Module, config: QuantizerConfig, path: Path) -> tuple[Counter[str], co.VerifyReport]:
    torch.manual_seed(1)
    batches = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    prepared = co.prepare(model, config, batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    co.export_onnx(converted, batches[0], path)
    ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
    return ops, co.verify_onnx(converted, path, batches)


@pytest.mark.parametrize("functional", [False, True])
def test_silu_runs_as_qlinear_sigmoid_and_qlinear_mul_with_no_float_op_and_matches_eager(
        tmp_path: Path, functional: bool) -> None:
    torch.manual_seed(0)
    ops, report = _ort_ops(_ConvSiLU(functional).eval(), W8A8(), tmp_path / "m.onnx")
    # before: DQ → Sigmoid → Mul → Q in float (Q 2 / DQ 2, Sigmoid 1, Mul 1)
    assert {op: ops[op] for op in ("QLinearConv", "QLinearSigmoid", "QLinearMul", "Sigmoid", "Mul",
                                   "QuantizeLinear", "DequantizeLinear")} == {
        "QLinearConv": 2, "QLinearSigmoid": 1, "QLinearMul": 1, "Sigmoid": 0, "Mul": 0,
        "QuantizeLinear": 1, "DequantizeLinear": 1}
    assert report.ok and report.outputs[0].max_diff_steps <= 1.0


def _activation_path(prepared: nn.Module) -> list[str]:
    """The ops and activation quantizers of a prepared graph in order (weights and biases left out)."""
    names = {torch.conv2d: "conv2d", torch.sigmoid: "sigmoid", torch.mul: "mul"}
    return [str(n.target) if n.op == "call_module" else names.get(n.target, str(n.target))
            for n in prepared.graph.nodes if n.op in ("call_module", "call_function")
            and "weight" not in str(n.target) and "bias" not in str(n.target)]


def test_a_config_for_op_kind_silu_keeps_the_silu_whole_and_applies() -> None:
    model = _ConvSiLU(functional=False).eval()
    float_silu = W8A8().set_op_kind("silu", None)
    gm = capture(model, (torch.randn(1, 3, 8, 8),))
    assert decompose_silu(gm, float_silu.resolve).changes == 0
    prepared = co.prepare(model, float_silu, (torch.randn(1, 3, 8, 8),))
    # the silu module stays one float op; act_output_fq is conv b's input quantizer
    assert _activation_path(prepared) == ["x_input_fq", "conv2d", "a_output_fq", "act", "act_output_fq", "conv2d",
                                          "b_output_fq"]


def test_split_silu_keeps_module_scope_so_module_name_configs_still_apply() -> None:
    model = _ConvSiLU(functional=False).eval()
    int16 = QuantizerConfig.presets.w8a16().activation
    config = W8A8().set_module_name("act", OpConfig(activation=int16))
    prepared = co.prepare(model, config, (torch.randn(1, 3, 8, 8),))
    path = _activation_path(prepared)
    assert path[path.index("sigmoid"):path.index("mul") + 1] == ["sigmoid", "act_output_fq", "mul"]
    modules = dict(prepared.named_modules())
    # the sigmoid's output and the product take module act's 16-bit spec; the convs keep the global 8-bit one
    assert {n: modules[n].spec.dtype for n in ("x_input_fq", "act_output_fq", "act_1_output_fq", "b_output_fq")} == {
        "x_input_fq": "uint8", "act_output_fq": "uint16", "act_1_output_fq": "uint16", "b_output_fq": "uint8"}


def test_a_float_silu_is_left_whole() -> None:
    model = _ConvSiLU(functional=False).eval()
    prepared = co.prepare(model, W8A8().set_module_name("act", None), (torch.randn(1, 3, 8, 8),))
    assert _activation_path(prepared) == ["x_input_fq", "conv2d", "a_output_fq", "act", "act_output_fq", "conv2d",
                                          "b_output_fq"]
    gm = capture(model, (torch.randn(1, 3, 8, 8),))
    assert decompose_silu(gm, QuantizerConfig.presets.w8().resolve).changes == 0  # weight-only: nothing to gain


def test_split_silu_matches_torch_silu_in_float_to_rounding() -> None:
    torch.manual_seed(0)
    model = _ConvSiLU(functional=True).eval()
    x = 4 * torch.randn(2, 3, 8, 8)
    gm = capture(model, (x,))
    assert decompose_silu(gm, W8A8().resolve).changes == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_silu_outside_a_4d_feature_map_is_left_whole() -> None:
    # a decoder MLP's [batch, sequence, hidden] silu: split, greedy generation of the test Llama stopped being
    # token-identical between onnxruntime and eager (decompose_silu's docstring)
    model = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 4)).eval()
    gm = capture(model, (torch.randn(2, 5, 8),))
    assert decompose_silu(gm, W8A8().resolve).changes == 0
