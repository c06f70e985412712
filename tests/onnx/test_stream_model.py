"""write_model writes exactly ``SerializeToString(deterministic=True)``, one initializer's encoding at a time."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx
from coreai_opt.onnx.export import stream_model as sm
from tests.zoo import build, preset_config


def _written(model: onnx.ModelProto) -> bytes:
    out = io.BytesIO()
    count = sm.write_model(model, out)
    assert count == len(out.getvalue())
    return out.getvalue()


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def _every_field_model() -> onnx.ModelProto:
    """A model with every ModelProto and GraphProto field set (checked below against the descriptors)."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    hidden = helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [2, 3])
    float_data = helper.make_tensor("f", onnx.TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])  # float_data, not raw
    external = helper.make_tensor("e", onnx.TensorProto.FLOAT, [2], [0.0, 0.0])
    external.ClearField("float_data")
    external.data_location = onnx.TensorProto.EXTERNAL
    entry = external.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    large = _tensor("w", (700, 1024), 1)  # 2.8 MB: its record length is a 4-byte varint
    sparse = helper.make_sparse_tensor(helper.make_tensor("sv", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]),
                                       helper.make_tensor("si", onnx.TensorProto.INT64, [2], [0, 3]), [2, 3])
    nodes = [helper.make_node("Add", ["x", "f"], ["h"], name="add", doc_string="n"),
             helper.make_node("Identity", ["h"], ["y"], name="id")]
    graph = helper.make_graph(nodes, "every_field", [x], [y], [float_data, large, empty, external],
                              doc_string="graph doc", value_info=[hidden], sparse_initializer=[sparse])
    annotation = graph.quantization_annotation.add()
    annotation.tensor_name = "h"
    param = annotation.quant_parameter_tensor_names.add()
    param.key, param.value = "SCALE_TENSOR", "f"
    helper.set_metadata_props(graph, {"graph_key": "graph_value"})
    function = helper.make_function("custom", "fn", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])],
                                    [helper.make_opsetid("", 21)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("custom", 1)],
                              producer_name="p", producer_version="1", domain="d", model_version=3,
                              doc_string="model doc", functions=[function])
    helper.set_metadata_props(model, {"model_key": "model_value"})
    training = model.training_info.add()
    training.initialization.CopyFrom(helper.make_graph([], "init", [], [], [_tensor("t", (4,), 2)]))
    configuration = model.configuration.add()
    configuration.name = "config"
    return model


def test_every_field_model_sets_every_model_and_graph_field() -> None:
    model = _every_field_model()
    for message in (model, model.graph):
        unset = {f.name for f in message.DESCRIPTOR.fields} - {f.name for f, _ in message.ListFields()}
        assert unset == set(), f"{type(message).__name__} fields not covered: {unset}"


def test_every_field_model_is_written_byte_identically() -> None:
    model = _every_field_model()
    assert sm.streams(model)
    assert _written(model) == model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("name,preset", [("resnet18", "w8a8"), ("transformer_encoder", "w4"),
                                         ("conv1d_groupnorm", "w8a8_sym"), ("mobilenet_v2", "fp8")])
def test_zoo_export_files_are_exactly_the_protobuf_serialisation(tmp_path: Path, name: str, preset: str) -> None:
    model, example, batches = build(name)
    config = preset_config(preset, model) if preset == "w4" else QuantizerConfig.presets.get(preset)()
    prepared = coreai_opt.prepare(model, config, example)
    coreai_opt.calibrate(prepared, batches, progress=False)
    path = export_onnx(coreai_opt.convert(prepared), example, tmp_path / "m.onnx")
    data = path.read_bytes()
    proto = onnx.load_from_string(data)
    assert len(proto.graph.initializer) > 3 and sm.streams(proto)
    assert data == proto.SerializeToString(deterministic=True) == _written(proto)


def _unknown_field(number: int) -> bytes:
    return sm._key(number) + sm._varint(3) + b"abc"


def test_unknown_fields_on_the_model_or_graph_fall_back_to_the_same_bytes() -> None:
    on_model = onnx.ModelProto()
    on_model.ParseFromString(_every_field_model().SerializeToString() + _unknown_field(99))
    on_graph = _every_field_model()
    on_graph.graph.MergeFromString(_unknown_field(98))
    for model in (on_model, on_graph):
        assert not sm.streams(model)
        assert _written(model) == model.SerializeToString(deterministic=True)


def test_unknown_fields_inside_an_initializer_still_stream_byte_identically() -> None:
    model = _every_field_model()
    model.graph.initializer[1].MergeFromString(_unknown_field(97))
    assert sm.streams(model)
    assert _written(model) == model.SerializeToString(deterministic=True)


def test_a_model_without_graph_or_with_an_empty_graph_is_written_byte_identically() -> None:
    no_graph = helper.make_model(helper.make_graph([], "g", [], []))
    no_graph.ClearField("graph")
    empty_graph = onnx.ModelProto()
    empty_graph.graph.SetInParent()
    assert not sm.streams(no_graph) and sm.streams(empty_graph)
    for model in (no_graph, empty_graph, onnx.ModelProto()):
        assert _written(model) == model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**21, 2**31 - 1, 2**35])
def test_varint_matches_protobufs_encoding(value: int) -> None:
    tensor = onnx.TensorProto(data_type=1)
    tensor.dims.append(value)  # field 1, varint: key 0x08 then varint(value)
    assert tensor.SerializeToString().startswith(b"\x08" + sm._varint(value))


def test_an_initializer_whose_size_changes_while_writing_raises_and_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _every_field_model()
    real = onnx.TensorProto.ByteSize
    monkeypatch.setattr(onnx.TensorProto, "ByteSize", lambda self: real(self) + 1)
    with pytest.raises(coreai_opt.errors.CoreaiOptRuntimeError, match="initializer 'f' encoded to"):
        sm.write_model(model, io.BytesIO())
