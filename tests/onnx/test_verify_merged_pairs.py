"""verify_onnx rule ``merged``: a tensor quantized twice in a row, which onnxruntime rounds once at other params."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import coreai_opt as co
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.onnx.verify.merged_pairs import merged_pairs
from tests.passes.test_drop_requantizations import _calibrated


def _pairs_model(first: tuple[float, int], second: tuple[float, int], source: str = "Relu") -> onnx.ModelProto:
    """x -> <source> -> Q(first) -> DQ -> Q(second) -> DQ -> y, uint8; ``source`` "DequantizeLinear" reads x's
    codes at ``first``'s params (a repeat of a quantizer on its own grid)."""
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in (
        ("s1", first[0], np.float32), ("z1", first[1], np.uint8), ("s2", second[0], np.float32),
        ("z2", second[1], np.uint8))]
    head = [helper.make_node("DequantizeLinear", ["x", "s1", "z1"], ["t"])] if source == "DequantizeLinear" else \
        [helper.make_node("Relu", ["x"], ["t"])]
    nodes = head + [helper.make_node("QuantizeLinear", ["t", "s1", "z1"], ["q1"]),
                    helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["d1"]),
                    helper.make_node("QuantizeLinear", ["d1", "s2", "z2"], ["q2"]),
                    helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["y"])]
    x_type = TensorProto.UINT8 if source == "DequantizeLinear" else TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    return helper.make_model(graph)


def test_a_pair_onnxruntime_merges_at_a_third_scale_is_found_with_onnxruntimes_numbers() -> None:
    (pair,) = merged_pairs(_pairs_model((0.004569051, 139), (0.0020850576, 0)))  # MobileViTV2's last layer
    assert pair.tensor == "q2" and (pair.file_scale, pair.file_zero_point) == (np.float32(0.0020850576), 0)
    assert (pair.scale, pair.zero_point) == (np.float32((255 - 139) * np.float32(0.004569051)) / 255, 0)
    assert not pair.requantizes_own_grid


def test_the_same_grid_twice_or_a_repeat_on_its_own_grid_inside_it_is_not_reported() -> None:
    assert merged_pairs(_pairs_model((0.01, 3), (0.01, 3))) == []
    one_step = float(np.nextafter(np.float32(0.01), np.float32(1)))  # hf Zamba: a repeat merged one float32 step off
    assert merged_pairs(_pairs_model((0.01, 3), (one_step, 3))) == []
    # a repeat of A on A's own codes, B's range inside A's: onnxruntime's merge is B itself
    assert merged_pairs(_pairs_model((0.004, 127), (0.002, 0), source="DequantizeLinear")) == []
    # the same repeat rounds twice where eager rounds once when the ranges do not nest: reported
    (pair,) = merged_pairs(_pairs_model((0.004, 130), (0.002, 0), source="DequantizeLinear"))
    assert pair.requantizes_own_grid and pair.scale != pair.file_scale


def test_verify_onnx_fails_a_file_with_the_pair_and_passes_it_without(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prepared, data = _calibrated()  # split -> relu: the relu's calibrated top lies above the conv output's grid
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (data[0],), tmp_path / "clean.onnx")
    assert co.verify_onnx(converted, path, data).ok
    convert_module = sys.modules["coreai_opt.api.convert"]
    monkeypatch.setattr(convert_module, "drop_requantizations", lambda gm: PassResult(gm, 0))
    with_pair = co.convert(prepared)
    path = co.export_onnx(with_pair, (data[0],), tmp_path / "pair.onnx")
    report = co.verify_onnx(with_pair, path, data)
    assert not report.ok
    (failing,) = [q for q in report.quantizers if not q.ok]
    assert failing.rule == "merged" and "scale 0.0084030787 / zero point 0" in failing.node
    assert "rounds it once, at other parameters than the file's and eager's: FAILS rule merged" in str(failing)
    torch.testing.assert_close(with_pair(data[0])[0], converted(data[0])[0], rtol=0, atol=0)  # same eager output
