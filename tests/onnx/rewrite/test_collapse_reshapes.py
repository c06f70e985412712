"""collapse_reshapes: reshapes that cancel or change nothing are dropped, value-identical."""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite.rules.collapse_reshapes import CollapseReshapes
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, rewrite_count

RULE = CollapseReshapes()

collapse_reshapes = functools.partial(rewrite_count, rule=RULE)


def _model(nodes: list[onnx.NodeProto], shapes: dict[str, list[int]], outputs: list[str],
           value_info: dict[str, list[int | str]] | None = None) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()]
    inits.append(numpy_helper.from_array(np.float32(0.5), "half"))
    graph = helper.make_graph(
        nodes, "reshapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits,
        value_info=[helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in (value_info or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _same_outputs(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    x = np.random.default_rng(0).standard_normal((3, 6, 4)).astype(np.float32)
    for a, b in zip(run(before, {"x": x}), run(after, {"x": x}), strict=True):
        np.testing.assert_array_equal(a, b)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_reshape_feeding_a_fixed_reshape_through_elementwise_ops_is_dropped() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "rows"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["r"]),
        helper.make_node("Mul", ["r", "half"], ["m"]),
        helper.make_node("Reshape", ["m", "heads"], ["y"]),
    ]
    model = _model(nodes, {"rows": [-1, 4], "heads": [-1, 6, 2, 2]}, ["y"], {"flat": ["?", 4], "r": ["?", 4]})
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert collapse_reshapes(model) == 1
    assert _ops(model) == ["Relu", "Mul", "Reshape"]
    assert "rows" not in {t.name for t in model.graph.initializer}  # its shape constant is gone too
    assert not {"flat", "r"} & {v.name for v in model.graph.value_info}  # stale shapes dropped
    _same_outputs(before, model)
    assert_idempotent(model, RULE)


def test_reshape_is_kept_when_a_value_has_another_reader_or_the_target_copies_dims() -> None:
    shared = [
        helper.make_node("Reshape", ["x", "rows"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["r"]),
        helper.make_node("Reshape", ["r", "heads"], ["y"]),
        helper.make_node("Identity", ["r"], ["z"]),  # a second reader sees the flattened shape
    ]
    model = _model(shared, {"rows": [-1, 4], "heads": [-1, 6, 2, 2]}, ["y", "z"])
    assert collapse_reshapes(model) == 0
    copying = [
        helper.make_node("Reshape", ["x", "rows"], ["flat"]),
        helper.make_node("Reshape", ["flat", "copy"], ["y"]),  # 0 = copy a dimension of the input
    ]
    model = _model(copying, {"rows": [-1, 4], "copy": [0, -1]}, ["y"])
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, ["the Reshape it reaches (y) has no fixed target shape"])
    assert model.SerializeToString() == before


def test_reshape_to_the_shape_its_input_already_has_is_dropped() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "rows"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["r"]),
        helper.make_node("Reshape", ["r", "rows"], ["y"]),  # r is already [-1, 4]
    ]
    model = _model(nodes, {"rows": [-1, 4]}, ["y"], {"r": [None, 4]})  # type: ignore[list-item]
    before = onnx.ModelProto()
    before.CopyFrom(model)
    removed = collapse_reshapes(model)
    # the first reshape feeds a fixed-shape reshape: dropped; then r is [b, 6, 4] (unknown) and the second stays
    assert removed == 1 and _ops(model) == ["Relu", "Reshape"]
    _same_outputs(before, model)
    identity = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "same"], ["s"]),
                helper.make_node("Neg", ["s"], ["y"])]
    model = _model(identity, {"same": [-1, 6, 4]}, ["y"], {"r": [None, 6, 4]})  # type: ignore[list-item]
    before.CopyFrom(model)
    assert collapse_reshapes(model) == 1 and _ops(model) == ["Relu", "Neg"]
    assert list(model.graph.node[1].input) == ["r"]
    _same_outputs(before, model)
    assert_idempotent(model, RULE)
