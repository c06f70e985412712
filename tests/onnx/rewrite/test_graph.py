"""OnnxGraph: live producer / reader maps across edits, constants, shapes, unique names, dead-code removal."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph


def _model() -> onnx.ModelProto:
    """x -> Relu(a) -> Mul(a, a)(b) -> Add(b, w)(y); a dead Neg(x)(d); c = Constant; w initializer."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mul", ["a", "a"], ["b"], name="mul"),
        helper.make_node("Constant", [], ["c"], name="const", value_ints=[2, 3]),
        helper.make_node("Add", ["b", "w"], ["y"], name="add"),
        helper.make_node("Neg", ["x"], ["d"], name="neg"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                     helper.make_tensor_value_info("w_override", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w"), numpy_helper.from_array(np.ones(2, np.int64), "unused"),
         numpy_helper.from_array(np.zeros(3, np.float32), "w_override")],
        value_info=[helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _names(nodes: list[onnx.NodeProto]) -> list[str]:
    return [n.name for n in nodes]


def test_producers_and_readers_are_indexed_in_graph_order_with_repeated_reads() -> None:
    graph = OnnxGraph(_model())
    assert graph.producer("b").name == "mul" and graph.producer("x") is None and graph.producer("w") is None
    assert _names(graph.readers("a")) == ["mul", "mul"]  # Mul(a, a) reads it twice
    assert _names(graph.readers("x")) == ["relu", "neg"]
    assert graph.only_reader("b").name == "add" and graph.only_reader("a") is None
    assert graph.only_reader("y") is None  # graph outputs never have an "only" reader


def test_edits_keep_producers_and_readers_right() -> None:
    graph = OnnxGraph(_model())
    mul, add = graph.producer("b"), graph.producer("y")
    square = helper.make_node("Pow", ["a", "two"], ["b2"], name="pow")
    graph.insert_before(add, [square])
    graph.set_input(add, 0, "b2")
    assert _names(graph.readers("b")) == [] and _names(graph.readers("b2")) == ["add"]
    assert _names(graph.readers("a")) == ["mul", "mul", "pow"]
    graph.replace(mul, [helper.make_node("Identity", ["a"], ["b"], name="id")])
    assert graph.producer("b").name == "id" and not graph.contains(mul)
    assert _names(graph.readers("a")) == ["id", "pow"]  # graph order after the replacement
    graph.replace_uses("a", "x")
    assert graph.readers("a") == [] and _names(graph.readers("x")) == ["relu", "id", "pow", "neg"]
    graph.remove_input(add, 1)
    assert graph.readers("w") == [] and list(add.input) == ["b2"]
    graph.set_output(square, 0, "b3")
    assert graph.producer("b3") is square and graph.producer("b2") is None
    assert _names(graph.nodes) == ["relu", "id", "const", "pow", "add", "neg"]


def test_constants_are_initializers_and_constant_nodes_but_not_overridable_inputs() -> None:
    graph = OnnxGraph(_model())
    np.testing.assert_array_equal(graph.constant("w"), np.ones(3, np.float32))
    assert graph.constant("c").tolist() == [2, 3] and graph.constant("c").dtype == np.int64
    assert graph.constant("w_override") is None  # an initializer that is also a graph input can be fed
    assert graph.initializer("w_override") is not None
    assert graph.constant("a") is None and graph.constant("missing") is None
    graph.set_initializer("w", np.full(3, 2.0, np.float32))
    assert graph.constant("w").tolist() == [2.0, 2.0, 2.0]
    assert numpy_helper.to_array(graph.initializer("w")).tolist() == [2.0, 2.0, 2.0]


def test_shapes_come_from_inputs_value_info_and_outputs() -> None:
    graph = OnnxGraph(_model())
    assert graph.shape("x") == ("batch", 3) and graph.shape("a") == ("batch", 3) and graph.rank("y") == 2
    assert graph.shape("b") is None and graph.rank("b") is None
    graph.annotate("b", TensorProto.FLOAT, [None, 3])
    assert graph.shape("b") == (None, 3) and [v.name for v in graph.proto.value_info] == ["a", "b"]
    graph.forget_shapes({"a"})
    assert graph.shape("a") is None and [v.name for v in graph.proto.value_info] == ["b"]


def test_unique_names_avoid_every_value_and_every_name_handed_out() -> None:
    graph = OnnxGraph(_model())
    assert graph.unique_name("fresh") == "fresh"
    assert graph.unique_name("fresh") == "fresh_1"  # handed out once: not again
    assert graph.unique_name("w") == "w_1" and graph.unique_name("x") == "x_1" and graph.unique_name("b") == "b_1"
    assert graph.unique_name("y") == "y_1"
    assert graph.unique_node_name("relu") == "relu_1" and graph.unique_node_name("b") == "b"
    graph.remove(graph.producer("d"))
    assert graph.unique_name("d") == "d_1"  # a removed node's output name stays reserved


def test_remove_dead_keeps_what_graph_outputs_need_and_drops_the_rest() -> None:
    model = _model()
    model.graph.output.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [3]))  # an initializer output
    graph = OnnxGraph(model)
    graph.remove_dead()
    assert _names(graph.nodes) == ["relu", "mul", "add"]  # the Neg and the unread Constant are gone
    assert [t.name for t in graph.initializers()] == ["w"]
    assert graph.producer("d") is None and graph.readers("x")[0].name == "relu" and len(graph.readers("x")) == 1
    graph.write_back()
    assert _names(list(model.graph.node)) == ["relu", "mul", "add"]
    onnx.checker.check_model(model)


def test_write_back_drops_the_value_info_of_values_no_node_produces_any_more() -> None:
    model = _model()
    model.graph.value_info.extend([helper.make_tensor_value_info("d", TensorProto.FLOAT, ["batch", 3]),
                                   helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])])
    graph = OnnxGraph(model)
    graph.remove(next(n for n in graph.nodes if n.name == "neg"))  # "d" is no longer produced
    graph.write_back()
    assert [v.name for v in model.graph.value_info] == ["a", "w"]  # a node output and an initializer stay
    onnx.checker.check_model(model)


def test_remove_dead_keeps_values_read_inside_subgraphs() -> None:
    then_graph = helper.make_graph([helper.make_node("Identity", ["t"], ["o"])], "then", [],
                                   [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("Neg", ["x"], ["t"]), helper.make_node("If", ["cond"], ["y"], then_branch=then_graph,
                                                                     else_branch=then_graph)]
    graph_proto = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                                    [numpy_helper.from_array(np.array(True), "cond")])
    graph = OnnxGraph(helper.make_model(graph_proto))
    graph.remove_dead()
    assert [n.op_type for n in graph.nodes] == ["Neg", "If"]


def test_sort_topologically_moves_nodes_behind_their_inputs_in_sweeps() -> None:
    model = _model()
    add = model.graph.node[3]
    add.input[1] = "w2"
    model.graph.node.append(helper.make_node("Sigmoid", ["x"], ["w2"], name="late"))  # produced after its reader
    graph = OnnxGraph(model)
    graph.sort_topologically()
    # first sweep: every node whose inputs exist, in order (the Add waits); second sweep: the Add
    assert _names(graph.nodes) == ["relu", "mul", "const", "neg", "late", "add"]
    relu = graph.producer("a")
    graph.insert_before(relu, [helper.make_node("Neg", ["y"], ["x2"], name="cycle")])
    graph.set_input(relu, 0, "x2")
    with pytest.raises(ValueError, match="cycle or a missing input"):
        graph.sort_topologically()
