"""Large initializers a rewrite writes are held outside the protobuf, freed when replaced, and land byte-identical."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.export import save as save_module
from coreai_opt.onnx.export.stream_model import write_model
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.initializers import DETACHED_BYTES

LARGE = (DETACHED_BYTES // 4 + 1,)  # one float32 more than the detach threshold


def _model() -> onnx.ModelProto:
    """y = x + small, with a large initializer read by an Identity, and the model's own large weight."""
    nodes = [helper.make_node("Add", ["x", "small"], ["y"], name="add"),
             helper.make_node("Identity", ["own"], ["z"], name="read_own")]
    inits = [numpy_helper.from_array(np.ones(3, np.float32), "small"),
             numpy_helper.from_array(np.full(LARGE, 2.0, np.float32), "own")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, list(LARGE))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _edit(graph: OnnxGraph) -> None:
    """Add a large initializer, replace it twice, replace the model's own large weight, add and drop another."""
    big = graph.add_initializer("big", np.full(LARGE, 3.0, np.float32))
    graph.set_initializer(big, np.full(LARGE, 4.0, np.float32))
    graph.set_initializer(big, np.full(LARGE, 5.0, np.float32))
    graph.set_initializer("own", np.full(LARGE, 6.0, np.float32))
    graph.add_initializer("gone", np.full(LARGE, 7.0, np.float32))
    graph.insert_after(graph.producer("z"), [helper.make_node("Identity", [big], ["w"], name="read_big")])
    graph.proto.output.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(LARGE)))
    graph.outputs = graph.outputs | {"w"}
    graph.remove_unread(["gone", "small"])  # "small" is still read: it stays


def _reference_bytes() -> bytes:
    """The file an edit session writes when every initializer is appended to the protobuf."""
    model = _model()
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(LARGE, 6.0, np.float32), "own"))
    model.graph.initializer.append(numpy_helper.from_array(np.full(LARGE, 5.0, np.float32), "big"))
    model.graph.node.append(helper.make_node("Identity", ["big"], ["w"], name="read_big"))
    model.graph.output.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(LARGE)))
    return model.SerializeToString(deterministic=True)


def test_a_large_initializer_a_rule_writes_stays_out_of_the_protobuf_until_write_back() -> None:
    model = _model()
    graph = OnnxGraph(model)
    _edit(graph)
    stubs = {t.name: t.ByteSize() for t in model.graph.initializer}
    assert list(stubs) == ["small", "own", "big"]  # "gone" removed at once, the file order kept
    assert stubs["big"] < 16 and stubs["own"] < 16  # name-only stubs: the 1 MiB values are held outside
    assert graph.initializer("big").ByteSize() > DETACHED_BYTES  # the rules read the detached message
    np.testing.assert_array_equal(graph.constant("big"), np.full(LARGE, 5.0, np.float32))
    graph.write_back()
    assert model.SerializeToString(deterministic=True) == _reference_bytes()


def test_detached_initializers_stream_into_the_same_bytes_and_are_consumed() -> None:
    model = _model()
    graph = OnnxGraph(model)
    _edit(graph)
    detached = graph.write_back(detached=True)
    assert sorted(detached) == ["big", "own"]
    out = io.BytesIO()
    write_model(model, out, detached)
    assert out.getvalue() == _reference_bytes()
    assert detached == {}  # each written tensor was dropped (freed) as it went


def test_detached_initializers_reach_the_external_data_file_of_a_large_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(save_module, "SINGLE_FILE_LIMIT_BYTES", 1000)  # force the external-data layout
    model = _model()
    graph = OnnxGraph(model)
    _edit(graph)
    path = tmp_path / "model.onnx"
    assert save_module.save_model_atomically(model, path, graph.write_back(detached=True))
    loaded = onnx.load(str(path))
    values = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert {name: float(v.flat[0]) for name, v in values.items()} == {"small": 1.0, "own": 6.0, "big": 5.0}
    assert values["big"].shape == LARGE


def test_a_small_initializer_is_stored_in_the_protobuf_directly() -> None:
    model = _model()
    graph = OnnxGraph(model)
    graph.add_initializer("tiny", np.arange(4, dtype=np.int64))
    assert numpy_helper.to_array(model.graph.initializer[-1]).tolist() == [0, 1, 2, 3]
    assert graph.write_back(detached=True) == {}


@pytest.mark.parametrize("detached", [False, True])
def test_write_back_copies_the_data_in_or_hands_it_back_beside_a_name_only_stub(detached: bool) -> None:
    model = _model()
    graph = OnnxGraph(model)
    _edit(graph)
    held = graph.write_back(detached=detached)
    big = next(t for t in model.graph.initializer if t.name == "big")
    if detached:
        assert not big.HasField("raw_data") and held["big"].HasField("raw_data")
    else:
        assert numpy_helper.to_array(big).flat[0] == 5.0
