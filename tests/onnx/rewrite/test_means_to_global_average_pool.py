"""means_to_global_average_pool: a quantized spatial mean becomes an integer GlobalAveragePool (and a CNN tail
exports with it and without its all-zero bias)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.rewrite.rules.means_to_global_average_pool import MeansToGlobalAveragePool
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent

RULE = MeansToGlobalAveragePool()


class _Tail(nn.Module):
    """conv -> BN (fresh: zero shift, so the folded bias is 0) -> relu -> global mean -> linear."""

    def __init__(self, keepdim: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.relu(self.bn(self.conv(x))).mean((2, 3), keepdim=self.keepdim)
        return self.fc(pooled.flatten(1))


@pytest.mark.parametrize("keepdim", [True, False])
def test_cnn_tail_exports_integer_global_pool_and_no_zero_bias(tmp_path: Path, keepdim: bool) -> None:
    torch.manual_seed(0)
    model = _Tail(keepdim).eval()
    batches = [(torch.rand(4, 3, 12, 12),) for _ in range(3)]
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.w8a8(), batches[0])
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, batches[0], tmp_path / "tail.onnx")
    nodes = onnx.load(str(path)).graph.node
    assert [n.op_type for n in nodes if n.op_type in ("ReduceMean", "GlobalAveragePool")] == ["GlobalAveragePool"]
    conv = next(n for n in nodes if n.op_type == "Conv")
    assert len(conv.input) == 2  # the folded all-zero bias is gone; the Gemm keeps its real bias
    assert len(next(n for n in nodes if n.op_type == "Gemm").input) == 3
    torch.manual_seed(1)
    report = verify_onnx(converted, path, [torch.rand(8, 3, 12, 12) for _ in range(4)])
    print(report)
    assert report.fusion.other_quantized.get("QLinearGlobalAveragePool") == 1
    assert not report.fusion.float_compute
    # the integer pool rounds its int32 sum once; the eager model rounds the float mean: at most one step apart
    assert report.outputs[0].max_diff_steps <= 1.0 and report.argmax_agreement == 1.0, str(report)


def _mean_graph(keepdims: int, size: int = 5) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.float32(0.02), "s"), numpy_helper.from_array(np.uint8(3), "z"),
             numpy_helper.from_array(np.float32(0.01), "so"), numpy_helper.from_array(np.uint8(0), "zo"),
             numpy_helper.from_array(np.array([-2, -1], np.int64), "axes")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("ReduceMean", ["xd", "axes"], ["m"], keepdims=keepdims),
        helper.make_node("QuantizeLinear", ["m", "so", "zo"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "so", "zo"], ["y"]),
    ]
    out_shape = ["N", 6, 1, 1] if keepdims else ["N", 6]
    shape = ["N", 6, size, size]
    graph = helper.make_graph(nodes, "mean", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits,
                              value_info=[helper.make_tensor_value_info("xd", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("keepdims", [1, 0])
def test_spatial_reduce_mean_becomes_global_average_pool_with_the_same_shape(keepdims: int) -> None:
    model = _mean_graph(keepdims)
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node if n.op_type in ("ReduceMean", "GlobalAveragePool", "Flatten")] == (
        ["GlobalAveragePool"] if keepdims else ["GlobalAveragePool", "Flatten"])
    assert "axes" not in {t.name for t in model.graph.initializer}  # left unused: removed
    x = np.random.default_rng(0).random((3, 6, 5, 5)).astype(np.float32) * 4
    (expected,), (got,) = run(before, {"x": x}), run(model, {"x": x})
    assert got.shape == expected.shape
    # the float mean is the same; it is quantized by the same Q, so the values match exactly here
    np.testing.assert_array_equal(got, expected)
    assert_idempotent(model, RULE)


def test_a_mean_over_a_1x1_map_stays_reduce_mean_where_onnxruntime_runs_it_faster() -> None:
    """QLinearGlobalAveragePool takes 16.7 µs on [1, 1280, 1, 1] against 8.2 µs for DQ -> ReduceMean -> Q."""
    model = _mean_graph(1, size=1)
    assert apply_rule(model, RULE) == (0, [])  # no rewrite and no near miss
    assert [n.op_type for n in model.graph.node].count("ReduceMean") == 1


@pytest.mark.parametrize(("axes", "reason"), [([1], "it reduces axes [1], not the spatial axes [2, 3]"),
                                              ([-1], "it reduces axes [-1], not the spatial axes [2, 3]")])
def test_a_mean_over_other_axes_is_left_alone_with_its_reason(axes: list[int], reason: str) -> None:
    model = _mean_graph(1)
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [reason])
    assert model.SerializeToString() == before


def test_a_mean_of_a_3d_tensor_is_no_candidate_and_one_of_unknown_rank_a_near_miss() -> None:
    model = _mean_graph(1)
    model.graph.value_info[0].type.tensor_type.shape.dim.pop()
    assert apply_rule(model, RULE) == (0, [])  # a sequence mean: not a spatial pool, nothing to report
    del model.graph.value_info[:]
    assert apply_rule(model, RULE) == (0, ["input rank is unknown (no shape recorded for it)"])


class _WholeMapPool(nn.Module):
    """Hugging Face EfficientNet's pooler: ``AvgPool2d(1280, ceil_mode=True)``, a window larger than the map."""

    def __init__(self, kernel: int, cells: int = 1) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(3, 16, 3), nn.AvgPool2d(kernel, ceil_mode=True)
        self.head = nn.Linear(16 * cells, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def test_an_average_pool_over_the_whole_map_runs_as_an_integer_global_pool_equal_to_eager(tmp_path: Path) -> None:
    # before: QLinearAveragePool divided by more than the 7 x 7 values inside the map: codes 133 steps low on
    # average (max 232), every one of them wrong, and verify_onnx failed (rule steps)
    torch.manual_seed(0)
    model = _WholeMapPool(1280).eval()
    batches = [torch.randn(2, 3, 9, 9) for _ in range(3)]
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.w8a8(), (batches[0],))
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, (batches[0],), tmp_path / "m.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "GlobalAveragePool" in ops and "AveragePool" not in ops
    report = verify_onnx(converted, path, [(b,) for b in batches])
    assert report.ok, str(report)
    pooled = next(q for q in report.quantizers if q.module == "pool")
    assert pooled.identical == 1.0 and pooled.max_abs == 0.0  # QLinearGlobalAveragePool: the eager codes exactly


def test_an_average_pool_over_part_of_the_map_stays_an_average_pool(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _WholeMapPool(4, cells=4).eval()  # 7 x 7 map -> 2 x 2 windows
    x = torch.randn(2, 3, 9, 9)
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.w8a8(), (x,))
    coreai_opt.calibrate(prepared, [x], progress=False)
    path = export_onnx(coreai_opt.convert(prepared), (x,), tmp_path / "m.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "AveragePool" in ops and "GlobalAveragePool" not in ops
