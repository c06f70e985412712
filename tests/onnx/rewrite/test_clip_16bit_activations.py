"""clip_16bit_activations: a Clip to the exact 16-bit range before every int16 / uint16 activation QuantizeLinear.

``Q(Clip(x)) == Q(x)`` for every float (onnxruntime, optimizer off so the Clip really runs), per-tensor Clip and
per-axis / blocked Max -> Min, the near misses, the exact "already inside" skip, idempotence, and onnxruntime
bit-identical on the minimal OpenVINO graph and on the zoo's w8a16 exports (five of the seven under ``-m slow``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import coreai_opt
from coreai_opt.onnx import export_onnx, rewrite
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rules.clip_16bit_activations import ClipSixteenBitActivations, saturation_bounds
from tests.onnx.onnx_graphs import run
from tests.onnx.openvino_graphs import conv_16bit_output
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops, rewrite_count
from tests.zoo import ZOO, build, preset_config

RULE = ClipSixteenBitActivations()
_ELEM = {np.uint16: TensorProto.UINT16, np.int16: TensorProto.INT16}


def _quantizer(scale: np.ndarray, zero_point: np.ndarray, shape: list[int], before: list[onnx.NodeProto] = (),
               attrs: dict[str, int] | None = None, inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """``x -> [before ->] QuantizeLinear(s, zp) -> q`` (the integers are the output); ``before`` ends in ``a``."""
    source = "a" if before else "x"
    nodes = [*before, helper.make_node("QuantizeLinear", [source, "s", "z"], ["q"], name="q16", **(attrs or {}))]
    elem = helper.np_dtype_to_tensor_dtype(zero_point.dtype)
    graph = helper.make_graph(nodes, "q16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("q", elem, shape)],
                              [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero_point, "z"), *inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _sweep(scale: float, zero_point: int, dtype: type) -> np.ndarray:
    """Every grid point and half point from 40 steps below the range to 40 above, the bounds' ulp neighbours,
    and far-out values (±1e30, ±inf, ±0)."""
    info = np.iinfo(dtype)
    steps = np.arange(info.min - zero_point - 40, info.max - zero_point + 41, dtype=np.float64)
    grid = np.concatenate([steps, steps + 0.5, steps - 0.5]) * scale
    low, high = saturation_bounds(np.array(scale, np.float32), np.array(zero_point, dtype), dtype)
    neighbours = [np.nextafter(b, direction * np.float32(np.inf)) for b in (low, high) for direction in (-1, 1)]
    nudged = [np.nextafter(n, np.float32(np.inf) * d) for n in neighbours for d in (-1, 1)]
    extremes = [1e30, -1e30, np.inf, -np.inf, 0.0, -0.0, low, high]
    return np.concatenate([grid, neighbours, nudged, extremes]).astype(np.float32)


SCALES = (1e-4, 6.0 / 65535, 0.0123457, 2.0**-15, 3.7e-7, 17.25)
ZERO_POINTS = [(np.uint16, 0), (np.uint16, 30000), (np.uint16, 65535), (np.int16, 0), (np.int16, -1000),
               (np.int16, 32767)]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(("dtype", "zero_point"), ZERO_POINTS)
def test_quantize_of_the_clipped_input_equals_quantize_of_the_input_for_every_float(scale: float, dtype: type,
                                                                                    zero_point: int) -> None:
    x = _sweep(scale, zero_point, dtype)
    plain = _quantizer(np.array(scale, np.float32), np.array(zero_point, dtype), [x.size])
    clipped = copy(plain)
    assert apply_rule(clipped, RULE) == (1, [])
    assert ops(clipped) == ["Clip", "QuantizeLinear"]
    expected = run(plain, {"x": x})[0]
    info = np.iinfo(dtype)
    assert expected.min() == info.min and expected.max() == info.max  # the sweep saturates on both sides
    np.testing.assert_array_equal(run(clipped, {"x": x})[0], expected)  # optimizer off: the Clip runs
    np.testing.assert_array_equal(run(clipped, {"x": x}, optimize=True)[0], expected)


@pytest.mark.parametrize(("dtype", "zero_point"), ZERO_POINTS)
def test_the_bounds_are_the_float32_of_the_exact_saturation_products(dtype: type, zero_point: int) -> None:
    model = _quantizer(np.array(1e-4, np.float32), np.array(zero_point, dtype), [8])
    rewrite_count(model, RULE)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    info, s = np.iinfo(dtype), float(np.float32(1e-4))
    assert stored["sixteen_bit_clip_low"] == np.float32((info.min - zero_point) * s)
    assert stored["sixteen_bit_clip_high"] == np.float32((info.max - zero_point) * s)
    assert stored["sixteen_bit_clip_low"].dtype == np.float32 and stored["sixteen_bit_clip_low"].shape == ()


@pytest.mark.parametrize(("dtype", "zero_point"), [(np.uint16, 0), (np.uint16, 30000), (np.int16, 0)])
def test_minimal_openvino_graph_gets_the_hand_written_clip_and_onnxruntime_stays_bit_identical(
        dtype: type, zero_point: int) -> None:
    x = (np.random.default_rng(1).standard_normal((2, 3, 8, 8)) * 10).astype(np.float32)
    model = conv_16bit_output(dtype, zero_point, clip=False)
    expected = run(model, {"x": x})[0]
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model, full_check=True)
    by_hand = conv_16bit_output(dtype, zero_point, clip=True)
    assert ops(model) == ops(by_hand) == ["Conv", "Clip", "QuantizeLinear", "DequantizeLinear"]
    hand = {t.name: numpy_helper.to_array(t) for t in by_hand.graph.initializer}
    ours = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert ours["sixteen_bit_clip_low"] == hand["lo"] and ours["sixteen_bit_clip_high"] == hand["hi"]
    assert np.abs(expected).max() > 3.2767  # the conv output leaves the 16-bit range: the clip matters
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)
    np.testing.assert_array_equal(run(model, {"x": x}, optimize=True)[0], expected)
    assert_idempotent(model, RULE)


def _clip(low: float, high: float) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    inits = [numpy_helper.from_array(np.array(low, np.float32), "c_lo"),
             numpy_helper.from_array(np.array(high, np.float32), "c_hi")]
    return [helper.make_node("Clip", ["x", "c_lo", "c_hi"], ["a"])], inits


def _uint16(before: list[onnx.NodeProto] = (), inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    return _quantizer(np.array(1e-4, np.float32), np.array(0, np.uint16), [4], before, inits=inits)


def test_an_input_already_clipped_inside_the_range_is_left_alone_exactly_at_the_bounds() -> None:
    low, high = (float(b) for b in saturation_bounds(np.array(1e-4, np.float32), np.array(0, np.uint16), np.uint16))
    assert rewrite_count(_uint16(*_clip(0.0, 6.0)), RULE) == 0  # ReLU6 under a 6.5535 range
    assert rewrite_count(_uint16(*_clip(low, high)), RULE) == 0  # exactly the bounds
    one_ulp_above = float(np.nextafter(np.float32(high), np.float32(np.inf)))
    assert rewrite_count(_uint16(*_clip(low, one_ulp_above)), RULE) == 1
    assert rewrite_count(_uint16(*_clip(-1e-4, 6.0)), RULE) == 1  # lower bound one step below qmin


def test_relu_alone_is_not_bounded_above_but_relu_then_min_is() -> None:
    relu = [helper.make_node("Relu", ["x"], ["a"])]
    model = _uint16(relu)
    assert apply_rule(model, RULE) == (1, [])
    assert ops(model) == ["Relu", "Clip", "QuantizeLinear"]
    six = numpy_helper.from_array(np.array(6.0, np.float32), "six")
    relu_min = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Min", ["six", "r"], ["a"])]
    assert rewrite_count(_uint16(relu_min, [six]), RULE) == 0


def test_per_axis_quantizer_gets_max_and_min_with_channel_bounds_and_stays_bit_exact() -> None:
    scale = np.array([1e-4, 2e-3, 3.3e-5], np.float32)
    zero_point = np.array([0, 1000, 65535], np.uint16)
    model = _quantizer(scale, zero_point, [2, 3, 5], attrs={"axis": 1})
    x = (np.random.default_rng(0).standard_normal((2, 3, 5)) * 200).astype(np.float32)
    expected = run(model, {"x": x})[0]
    assert apply_rule(model, RULE) == (1, [])
    assert ops(model) == ["Max", "Min", "QuantizeLinear"]
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    low, high = saturation_bounds(scale, zero_point, np.uint16)
    np.testing.assert_array_equal(stored["sixteen_bit_clip_low"], low.reshape(1, 3, 1))
    np.testing.assert_array_equal(stored["sixteen_bit_clip_high"], high.reshape(1, 3, 1))
    assert (expected == 0).any() and (expected == 65535).any()
    np.testing.assert_array_equal(run(model, {"x": x})[0], expected)
    assert_idempotent(model, RULE)


def test_blocked_quantizer_bounds_repeat_each_block_along_its_axis() -> None:
    scale = np.array([[1e-4, 5e-3]], np.float32)  # x [1, 6], blocks of 4 along axis 1 (the last one partial)
    zero_point = np.array([[0, -7]], np.int16)
    model = _quantizer(scale, zero_point, [1, 6], attrs={"axis": 1, "block_size": 4})
    assert apply_rule(model, RULE) == (1, [])
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    low, _ = saturation_bounds(scale, zero_point, np.int16)
    np.testing.assert_array_equal(stored["sixteen_bit_clip_low"], low[:, [0, 0, 0, 0, 1, 1]])
    x = np.array([[-9.0, -3.2, 0.1, 3.3, -200.0, 200.0]], np.float32)
    # onnxruntime 1.32 has no blocked int16 QuantizeLinear: check with the ONNX reference evaluator
    from onnx.reference import ReferenceEvaluator

    plain = _quantizer(scale, zero_point, [1, 6], attrs={"axis": 1, "block_size": 4})
    expected = ReferenceEvaluator(plain).run(None, {"x": x})[0]
    assert expected.tolist() == [[-32768, -32000, 1000, 32767, -32768, 32767]]
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], expected)


def test_weights_and_other_types_are_not_candidates() -> None:
    weight = numpy_helper.from_array(np.ones(4, np.float32), "w")
    stored = _quantizer(np.array(1e-4, np.float32), np.array(0, np.uint16), [4], inits=[weight])
    stored.graph.node[0].input[0] = "w"
    assert apply_rule(stored, RULE) == (0, [])
    eight_bit = _quantizer(np.array(1e-2, np.float32), np.array(0, np.uint8), [4])
    assert apply_rule(eight_bit, RULE) == (0, [])


def test_near_misses_name_the_check_that_failed() -> None:
    dynamic = _quantizer(np.array(1e-4, np.float32), np.array(0, np.uint16), [4])
    dynamic.graph.node.insert(0, helper.make_node("Identity", ["s"], ["s_dynamic"]))
    dynamic.graph.node[1].input[1] = "s_dynamic"
    assert apply_rule(dynamic, RULE) == (
        0, ["16-bit quantizer with a scale or zero point computed in the graph: no constant clip bounds"])
    negative = _quantizer(np.array(-1e-4, np.float32), np.array(0, np.uint16), [4])
    assert apply_rule(negative, RULE) == (
        0, ["16-bit quantizer with a scale that is not positive: the saturation is not a clip"])
    unknown_rank = _quantizer(np.array([1e-4, 1e-4], np.float32), np.array([0, 0], np.uint16), [2, 2],
                              attrs={"axis": 1})
    del unknown_rank.graph.input[0].type.tensor_type.shape.dim[:]
    unknown_rank.graph.input[0].type.tensor_type.ClearField("shape")
    assert apply_rule(unknown_rank, RULE) == (
        0, ["per-axis / blocked 16-bit quantizer of a value of unknown rank: no bounds to broadcast"])


def test_a_float16_bound_that_does_not_quantize_to_qmax_is_a_near_miss() -> None:
    """float16 has 11 significant bits: 64535 * 0.0041924 rounds to 270.5, which quantizes to 65522, not 65535."""
    model = _quantizer(np.array(0.004192352294921875, np.float16), np.array(1000, np.uint16), [4])
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    assert apply_rule(model, RULE) == (
        0, ["the clip bounds of this float16 scale do not quantize exactly to the 16-bit range"])


@pytest.mark.parametrize(("dtype", "zero_point"), ZERO_POINTS)
def test_float32_bounds_quantize_to_qmin_and_qmax_for_scales_from_1e_minus_30_to_1e30(dtype: type,
                                                                                   zero_point: int) -> None:
    """The docstring's bound |fl(b / s) - k| < 2^-6 on 100 000 log-uniform float32 scales (numpy, float32 division)."""
    scale = np.exp(np.random.default_rng(0).uniform(np.log(1e-30), np.log(1e30), 100_000)).astype(np.float32)
    zero = np.full(scale.shape, zero_point, dtype)
    low, high = saturation_bounds(scale, zero, dtype)
    info = np.iinfo(dtype)
    for bound, k in ((low, info.min - zero_point), (high, info.max - zero_point)):
        assert bound.dtype == np.float32
        assert np.abs(bound / scale - np.float32(k)).max() < 2.0**-6


def _export_w8a16(name: str, path: Path, rules: tuple[rewrite.Rule, ...]) -> tuple[Path, list[np.ndarray]]:
    """Export the zoo model under w8a16 with the post-passes ``rules``; return the file and 64 inputs."""
    model, example, batches = build(name)
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("ignore")
        prepared = coreai_opt.prepare(model, preset_config("w8a16", model), example)
        coreai_opt.calibrate(prepared, batches, progress=False)
        patch.setattr(rewrite, "POST_PASSES", rules)
        export_onnx(coreai_opt.convert(prepared), example, path)
    torch.manual_seed(123)
    return path, [ZOO[name].make_input(16).numpy() for _ in range(4)]


def _outputs(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed_name = session.get_inputs()[0].name
    return [out for x in inputs for out in session.run(None, {feed_name: x})]


_SMALL = ("shape_unpack", "conv1d_groupnorm")
#: Measured activation quantizers per zoo w8a16 file (all of them get a Clip; docs/openvino.md).
_SIXTEEN_BIT_QUANTIZERS = {"resnet18": 33, "mobilenet_v2": 68, "conv_transpose_decoder": 8,
                           "transformer_encoder": 41, "torch_transformer": 38, "shape_unpack": 4,
                           "conv1d_groupnorm": 8}


@pytest.mark.parametrize("name", [n if n in _SMALL else pytest.param(n, marks=pytest.mark.slow) for n in ZOO])
def test_every_16_bit_quantizer_of_a_zoo_w8a16_export_gets_a_clip_and_onnxruntime_stays_bit_identical(
        name: str, tmp_path: Path) -> None:
    without = tuple(rule for rule in rewrite.POST_PASSES if rule.name != RULE.name)
    path, inputs = _export_w8a16(name, tmp_path / "unclipped.onnx", without)
    unclipped = onnx.load(str(path))
    clipped = copy(unclipped)
    assert apply_rule(clipped, RULE) == (_SIXTEEN_BIT_QUANTIZERS[name], [])
    onnx.checker.check_model(clipped)
    for node in clipped.graph.node:  # every 16-bit activation quantizer now reads a Clip of its exact range
        view = QdqView.of(node, rewrite.OnnxGraph(clipped))
        if view is not None and not view.is_dequantize and view.type_name in ("int16", "uint16"):
            assert next(n for n in clipped.graph.node if view.data in n.output).op_type == "Clip"
    for before, after in zip(_outputs(unclipped, inputs), _outputs(clipped, inputs), strict=True):
        assert np.abs(after - before).max() == 0.0
    assert_idempotent(clipped, RULE)


def test_the_export_inserts_the_clips_as_its_last_post_pass(tmp_path: Path) -> None:
    """``export_onnx`` with all post-passes writes the graph of (every other post-pass, then this rule)."""
    exported, _ = _export_w8a16("conv1d_groupnorm", tmp_path / "exported.onnx", rewrite.POST_PASSES)
    without = tuple(rule for rule in rewrite.POST_PASSES if rule.name != RULE.name)
    unclipped, _ = _export_w8a16("conv1d_groupnorm", tmp_path / "unclipped.onnx", without)
    clipped = onnx.load(str(unclipped))
    apply_rule(clipped, RULE)
    assert onnx.load(str(exported)).graph.SerializeToString() == clipped.graph.SerializeToString()
    assert rewrite.read_report(onnx.load(str(exported))).counts[RULE.name] == 8
