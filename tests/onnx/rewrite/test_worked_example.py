"""The "how to add a rule" example of docs/ARCHITECTURE.md, written out and run: the contract is enough for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite import Fail, Match, OnnxGraph, Rule
from coreai_opt.onnx.rewrite.graph import attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops


@dataclass(frozen=True)
class _Site(Match):
    count: int  # elements averaged


class ReduceMeanToSum(Rule):
    name = "reduce_mean_to_sum"
    anchors = frozenset({"ReduceMean"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        if QdqView.of(graph.producer(node.input[0]), graph) is None:
            return None
        shape, axes = graph.shape(node.input[0]), graph.constant(node.input[1])
        if shape is None or axes is None or not all(isinstance(shape[a], int) for a in axes):
            return Fail("reduced dimensions are not static")
        return _Site(node, math.prod(shape[a] for a in axes))

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        node = match.node
        summed = graph.unique_name(f"{node.output[0]}_sum")
        count = graph.add_initializer(graph.unique_name(f"{node.name}_count"),
                                        np.array(match.count, np.float32))
        graph.replace(node, [helper.make_node("ReduceSum", list(node.input), [summed], **attributes_of(node)),
                             helper.make_node("Div", [summed, count], list(node.output))])


def _mean_graph(spatial: list[int | str]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.float32(1 / 64), "s"), numpy_helper.from_array(np.uint8(0), "z"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("ReduceMean", ["xd", "axes"], ["m"], name="mean", keepdims=1),
             helper.make_node("QuantizeLinear", ["m", "s", "z"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, *spatial])]
    graph = helper.make_graph(nodes, "mean", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, ["N", 3, 1, 1])], inits,
                              value_info=[helper.make_tensor_value_info("xd", TensorProto.FLOAT, ["N", 3, *spatial])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_documented_example_rule_rewrites_a_quantized_mean_into_sum_and_divide() -> None:
    model = _mean_graph([4, 4])
    before = copy(model)
    assert apply_rule(model, ReduceMeanToSum()) == (1, [])
    assert ops(model) == ["QuantizeLinear", "DequantizeLinear", "ReduceSum", "Div", "QuantizeLinear"]
    x = np.random.default_rng(0).random((2, 3, 4, 4)).astype(np.float32) * 3
    np.testing.assert_array_equal(run(model, {"x": x})[0], run(before, {"x": x})[0])  # ReduceMean is sum / n
    assert_idempotent(model, ReduceMeanToSum())


def test_the_documented_example_rule_records_its_near_miss() -> None:
    model = _mean_graph(["H", "W"])
    assert apply_rule(model, ReduceMeanToSum()) == (0, ["reduced dimensions are not static"])
