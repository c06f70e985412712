"""average_pools_as_depthwise_convs: a quantized windowed AveragePool is written as a depthwise Conv (onnxruntime runs
QLinearConv, not its slow QLinearAveragePool), within one code of the pool, and a whole model still verifies."""

from __future__ import annotations

from collections import Counter
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
from coreai_opt.onnx.rewrite.rules.average_pools_as_depthwise_convs import AveragePoolsAsDepthwiseConvs
from coreai_opt.onnx.verify.fusion_report import optimized_model
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent

RULE = AveragePoolsAsDepthwiseConvs()
SCALE = 0.05


def _pool_graph(channels: int, size: int, **pool: object) -> onnx.ModelProto:
    """``x -> Q -> DQ -> AveragePool(**pool) -> Q -> DQ``, uint8, step 0.05."""
    inits = [numpy_helper.from_array(np.float32(SCALE), "s"), numpy_helper.from_array(np.uint8(128), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("AveragePool", ["xd"], ["pooled"], name="pool", **pool),
             helper.make_node("QuantizeLinear", ["pooled", "s", "z"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["n", channels, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
                              value_info=[helper.make_tensor_value_info("xd", TensorProto.FLOAT,
                                                                        ["n", channels, size, size])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("pool", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1},
])
def test_windowed_pools_become_float_depthwise_convs_with_the_pools_codes(pool: dict[str, object],
                                                                          tmp_path: Path) -> None:
    model = _pool_graph(16, 8, **pool)
    x = np.random.default_rng(0).standard_normal((2, 16, 8, 8)).astype(np.float32) * 3
    expected = run(model, {"x": x})[0]
    assert apply_rule(model, RULE) == (1, [])
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert {a.name: helper.get_attribute_value(a) for a in conv.attribute} == {
        "group": 16, "kernel_shape": pool["kernel_shape"], "strides": pool["strides"],
        "pads": pool.get("pads", [0, 0, 0, 0])}
    got = run(model, {"x": x})[0]
    # the requantization of an int32 sum (scale s_x · s_w / s_y) against the pool's average can move a value that
    # sits on a rounding tie by one code
    codes = np.abs(got - expected) / SCALE
    assert codes.max() <= 1 + 1e-4 and np.mean(codes > 0.5) < 0.01
    onnx.save(model, str(tmp_path / "pool.onnx"))
    optimized = Counter(n.op_type for n in optimized_model(tmp_path / "pool.onnx", level="all").graph.node)
    assert optimized["QLinearAveragePool"] == 0
    assert_idempotent(model, RULE)


def test_a_pool_that_excludes_padding_is_a_near_miss_and_a_global_or_unquantized_pool_no_candidate() -> None:
    excluded = _pool_graph(4, 8, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    before = excluded.SerializeToString()
    assert apply_rule(excluded, RULE) == (0, [
        "padding excluded from the count (count_include_pad=0): border windows average fewer values"])
    assert excluded.SerializeToString() == before
    whole = _pool_graph(4, 4, kernel_shape=[4, 4])
    whole.graph.value_info.append(helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["n", 4, 1, 1]))
    assert apply_rule(whole, RULE) == (0, [])


class _AvgDown(nn.Module):
    """ResNet-D / ResNeSt's shortcut ``conv(avg_pool(relu(conv(x)), 3, 2, 1))`` and a global pool head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.down = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.pool, self.head = nn.AvgPool2d(3, 2, padding=1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.pool(torch.relu(self.stem(x))))
        return self.head(nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


def test_an_avg_down_block_exports_its_pool_as_a_float_conv_and_verifies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(2, 3, 16, 16),) for _ in range(3)]
    prepared = coreai_opt.prepare(_AvgDown().eval(), QuantizerConfig.presets.w8a8(), batches[0])
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, batches[0], tmp_path / "avg_down.onnx")
    ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
    # onnxruntime quantizes the depthwise weight itself and runs the pool as its third QLinearConv
    assert ops["QLinearAveragePool"] == 0 and ops["QLinearConv"] == 3 and ops["QLinearGlobalAveragePool"] == 1
    report = verify_onnx(converted, path, batches)
    assert report.ok, str(report)
