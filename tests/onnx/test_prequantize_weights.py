"""Large weights quantized in chunks ahead of the fold write the whole-tensor fold's file, byte for byte (issue 20)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn
from torch.onnx._internal.exporter._errors import ConversionError

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as onnx_export
import coreai_opt.onnx.export.prequantize_weights as prequantize
from coreai_opt.onnx.rewrite.constant_folder import evaluate_node


def _converted(preset: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 64), nn.ReLU(),
                          nn.Linear(64, 10)).eval()
    x = torch.randn(4, 3, 8, 8)
    prepared = co.prepare(model, getattr(co.QuantizerConfig.presets, preset)(), (x,))
    co.calibrate(prepared, [x, torch.randn(4, 3, 8, 8)], progress=False)
    return co.convert(prepared), x


def _export_both_ways(converted: nn.Module, x: torch.Tensor, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 1 << 62)  # off: the fold evaluates every weight
    whole = co.export_onnx(converted, (x,), tmp_path / "whole.onnx").read_bytes()
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 0)  # every weight, in chunks of one row
    monkeypatch.setattr(prequantize, "CHUNK_BYTES", 64)
    chunked = co.export_onnx(converted, (x,), tmp_path / "chunked.onnx").read_bytes()
    return whole, chunked


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_sym", "w4", "w4a8", "w8a16", "fp8"])
def test_chunked_weights_give_the_whole_fold_file_byte_for_byte(preset, tmp_path, monkeypatch):
    converted, x = _converted(preset)
    whole, chunked = _export_both_ways(converted, x, tmp_path, monkeypatch)
    assert chunked == whole
    model = onnx.load_from_string(chunked)
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0].endswith("weight")]


def _count_quantize_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one entry per ``quantize_rows`` call from now on."""
    calls: list[int] = []
    original = prequantize.quantize_rows

    def counting(*args: object) -> object:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(prequantize, "quantize_rows", counting)
    return calls


def _fail_like_torch(*args: object) -> object:
    raise ConversionError("Failed to decompose the FX graph for ONNX compatibility.") from ValueError("Cannot view")


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_sym"])
def test_the_torchscript_route_chunks_too_and_writes_the_same_bytes(preset, tmp_path, monkeypatch):
    converted, x = _converted(preset)
    monkeypatch.setattr(onnx_export, "_dynamo_export", _fail_like_torch)
    calls = _count_quantize_rows(monkeypatch)
    with pytest.warns(UserWarning, match="TorchScript exporter"):
        whole, chunked = _export_both_ways(converted, x, tmp_path, monkeypatch)
    assert chunked == whole
    assert len(calls) == 3  # the conv and both linears, each in chunks


def test_no_float_copy_of_a_large_weight_reaches_the_protobuf(monkeypatch):
    converted, x = _converted("w8a8")
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 4096)
    proto, quantized, _ = onnx_export._export_proto(converted, (x,), 18, [{0: "batch"}], ["x"], ["output"])
    assert list(quantized.values())[0].dtype == np.int8 and list(quantized.values())[0].shape == (64, 576)
    assert len(quantized) == 1  # 3.weight (64 x 576 floats) is the only weight of at least 4096 bytes
    large_float = [t.name for t in proto.graph.initializer
                   if t.data_type == onnx.TensorProto.FLOAT and len(t.raw_data) >= 4096]
    assert large_float == []
    placeholders = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert placeholders == ["3.weight"]


def test_the_deferred_integers_are_computed_when_the_fold_reads_them_not_before(monkeypatch):
    converted, x = _converted("w8a8")
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 4096)
    calls = _count_quantize_rows(monkeypatch)
    _, quantized, _ = onnx_export._export_proto(converted, (x,), 18, [{0: "batch"}], ["x"], ["output"])
    assert isinstance(quantized, prequantize.DeferredValues) and len(quantized) == 1 and calls == []
    name = next(iter(quantized))
    first, again = quantized[name], quantized[name]
    assert len(calls) == 2 and np.array_equal(first, again)  # computed on each read, the same integers
    assert first.dtype == np.int8 and first.shape == (64, 576)
    del quantized[name]
    assert len(quantized) == 0 and len(calls) == 2  # deleting does not compute


def test_a_layer_wider_than_the_exporters_fold_limit_is_chunked_and_matches(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8200), nn.ReLU(), nn.Linear(8200, 4)).eval()  # 8200 > 8192 channels
    x = torch.randn(3, 16)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 0)
    _, quantized, _ = onnx_export._export_proto(converted, (x,), 18, [{0: "batch"}], ["x"], ["output"])
    assert sorted(v.shape for v in quantized.values()) == [(4, 8200), (8200, 16)]  # its zero point is a Cast
    whole, chunked = _export_both_ways(converted, x, tmp_path, monkeypatch)
    assert chunked == whole


def test_a_placeholder_the_fold_left_is_an_error_not_a_missing_weight():
    model = helper.make_model(helper.make_graph([], "g", [], []))
    stub = model.graph.initializer.add()
    stub.name, stub.data_type, stub.data_location = "w", onnx.TensorProto.FLOAT, onnx.TensorProto.EXTERNAL
    entry = stub.external_data.add()
    entry.key, entry.value = "location", prequantize.DEFERRED_LOCATION
    with pytest.raises(co.errors.CoreaiOptRuntimeError, match=r"internal error: the weights \['w'\]"):
        prequantize.check_no_deferred_weights(model)


@pytest.mark.parametrize(("axis", "block_size", "zero_point"), [(0, 0, True), (1, 0, True), (0, 0, False),
                                                                (1, 4, True), (0, 4, True), (-1, 0, True)])
def test_row_chunks_equal_the_whole_tensor_evaluation(axis, block_size, zero_point, monkeypatch):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((12, 12)) * 3).astype(np.float32)  # square: a channel axis 1 is not sliced
    if block_size:
        shape = (12 // block_size, 12) if axis == 0 else (12, 12 // block_size)
    else:
        shape = (12,)
    scale = rng.uniform(0.01, 0.05, shape).astype(np.float32)
    zp = rng.integers(-5, 5, shape).astype(np.int8) if zero_point else None
    attrs = {"axis": axis, **({"block_size": block_size} if block_size else {})}
    node = helper.make_node("QuantizeLinear", ["w", "s", *(["z"] if zero_point else [])], ["q"], **attrs)
    whole = evaluate_node(node, [weight, scale, *([zp] if zero_point else [])])
    monkeypatch.setattr(prequantize, "CHUNK_BYTES", 100)  # 2 rows at a time (4 with blocks along the rows)
    chunked = prequantize.quantize_rows(node, weight, scale, zp)
    assert chunked.dtype == whole.dtype
    np.testing.assert_array_equal(chunked, whole)
    assert len(np.unique(chunked)) > 20  # real values, not a constant


def test_a_refused_weight_is_left_to_the_fold():
    node = helper.make_node("QuantizeLinear", ["w", "s"], ["q"], axis=0)
    weight = np.ones((4, 4), dtype=np.float16)  # the fold quantizes float32 only
    assert prequantize.quantize_rows(node, weight, np.ones(4, np.float32), None) is None
    assert isinstance(evaluate_node(node, [weight, np.ones(4, np.float32)]), str)


def test_a_prequantized_file_holds_no_placeholder_and_real_int8_weights(tmp_path, monkeypatch):
    converted, x = _converted("w8a8")
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 0)
    model = onnx.load(str(co.export_onnx(converted, (x,), tmp_path / "m.onnx")))
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "3.weight_quantized"))
    assert weight.dtype == np.int8 and weight.shape == (64, 576) and int(np.abs(weight).max()) >= 100


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_sym"])  # narrow-range clamp moved into the integers, and none
def test_the_fold_uses_up_every_precomputed_weight_and_stores_each_once(preset, monkeypatch):
    from coreai_opt.onnx import rewrite

    converted, x = _converted(preset)
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 4096)
    proto, quantized, detached = onnx_export._export_proto(converted, (x,), 18, [{0: "batch"}], ["x"], ["output"])
    assert len(quantized) == 1
    report = rewrite.apply(proto, rewrite.POST_PASSES, precomputed=quantized, detached=detached)
    assert quantized == {}  # freed during the rewrite, not held to its end
    stored = [t for t in proto.graph.initializer if t.name == "3.weight_quantized"]
    assert len(stored) == 1 and stored[0].data_type == onnx.TensorProto.INT8
    values = numpy_helper.to_array(stored[0])
    assert values.shape == (64, 576) and values.min() >= -127  # both presets use the narrow int8 weight grid
    assert report.counts["fold_quantized_weights"] >= 3
    assert not [n for n in proto.graph.node if n.op_type in ("Max", "Min", "Clip", "QuantizeLinear")
                and n.input[0].startswith("3.weight")]


def test_every_other_large_initializer_is_held_apart_as_its_exporters_own_bytes(tmp_path, monkeypatch):
    converted, x = _converted("w4")  # per-block scales and zero points: 64 x 18 blocks of the 64 x 576 linear
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 1024)
    proto, _, detached = onnx_export._export_proto(converted, (x,), 21, [{0: "batch"}], ["x"], ["output"])
    stubs = {t.name for t in proto.graph.initializer
             if any(e.key == "location" and e.value == prequantize.DETACHED_LOCATION for e in t.external_data)}
    assert stubs and stubs == set(detached)  # each stub's tensor is held apart, nothing else is
    assert all(len(t.raw_data) < 1024 for t in proto.graph.initializer)  # no large tensor in the protobuf
    assert all(t.ByteSize() >= 1024 and t.name == name for name, t in detached.items())
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 1 << 62)  # nothing held apart: the same file
    whole = co.export_onnx(converted, (x,), tmp_path / "whole.onnx").read_bytes()
    monkeypatch.setattr(prequantize, "PREQUANTIZE_MIN_BYTES", 1024)
    assert co.export_onnx(converted, (x,), tmp_path / "apart.onnx").read_bytes() == whole
