"""linears_to_gemm (+ collapse_reshapes): rank > 2 quantized linears run as QGemm, value-identical."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, fusion_report, verify_onnx
from coreai_opt.onnx.rewrite import apply
from coreai_opt.onnx.rewrite.rules.collapse_reshapes import CollapseReshapes
from coreai_opt.onnx.rewrite.rules.linears_to_gemm import LinearsToGemm
from tests.onnx.onnx_graphs import run, save
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent

RNG = np.random.default_rng(11)
K, N = 16, 8
RULE = LinearsToGemm()


class _TokenMlp(nn.Module):
    """Linear -> GELU -> Linear on ``[batch, seq, dim]``, plus a residual add (a transformer's MLP block)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(self.act(self.fc1(x)))
        return self.head(x).mean(dim=1)


def _rewrite_checked(model: onnx.ModelProto, expected_rewrites: int
                     ) -> tuple[onnx.ModelProto, collections.Counter[str]]:
    """A copy of ``model`` after linears_to_gemm + collapse_reshapes, checked, and its op counts.

    Checks: ``expected_rewrites`` linears rewritten, no near miss, a valid model.
    """
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    report = apply(rewritten, [RULE, CollapseReshapes()])
    assert report.counts[RULE.name] == expected_rewrites and not report.skipped
    onnx.checker.check_model(rewritten, full_check=True)
    return rewritten, collections.Counter(n.op_type for n in rewritten.graph.node)


def _op_counts(path: Path) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _export(model: nn.Module, preset: str, path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    example = torch.randn(2, 12, 32)
    prepared = coreai_opt.prepare(model.eval(), getattr(QuantizerConfig.presets, preset)(), (example,))
    coreai_opt.calibrate(prepared, [(torch.randn(4, 12, 32),) for _ in range(4)], progress=False)
    converted = coreai_opt.convert(prepared)
    return converted, export_onnx(converted, (example,), path)


def test_w8a8_linears_on_3d_inputs_export_as_gemm_and_run_as_qgemm_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    converted, path = _export(_TokenMlp(), "w8a8", tmp_path / "mlp.onnx")
    counts = _op_counts(path)
    assert counts["Gemm"] == 3 and counts["MatMul"] == 0
    assert counts["Gelu"] == 1  # opset 20 picked for the GELU: one op, not Erf/Div/Add/Mul
    # fc1 -> GELU -> fc2 keep the 2-D rows between them (flatten before fc1, unflatten before the residual add);
    # the head reads the 3-D sum and feeds the mean over the sequence: one flatten and one unflatten more
    assert counts["Reshape"] == 4
    torch.manual_seed(5)
    report = verify_onnx(converted, path, [torch.randn(b, 12, 32) for b in (1, 3, 7)])
    print(report)
    assert report.fusion.integer_compute == {"QGemm": 3} and not report.fusion.float_compute
    # every quantizer's codes are identical; the mean over the sequence after the head is a float reduction
    # (no integer kernel: it asks no quantizer of its own), so the output differs only by float summation order
    assert report.quantizers and all(q.identical == 1.0 for q in report.quantizers), str(report)
    assert report.ok and report.outputs[0].max_abs_diff <= 1e-6, str(report)


def test_linears_keep_matmul_where_onnxruntime_fuses_matmul(tmp_path: Path) -> None:
    """Blocked int4 weights -> MatMulNBits and dynamic activations -> DynamicQuantizeMatMul need MatMul."""
    torch.manual_seed(0)
    for preset, fused in (("w4", "MatMulNBits"), ("w8a8_dynamic", "DynamicQuantizeMatMul")):
        _, path = _export(_TokenMlp(), preset, tmp_path / f"{preset}.onnx")
        counts = _op_counts(path)  # w4: the file carries our own MatMulNBits (issue 15), never a Gemm
        assert counts["MatMul"] + counts["MatMulInteger"] + counts["MatMulNBits"] >= 2 and not counts["Gemm"], preset
        assert fusion_report(path).integer_compute.get(fused, 0) >= 2, preset


def _linear_graph(lead: list[str | int], bias: bool, output_q: bool) -> onnx.ModelProto:
    """uint8 QDQ ``y = x @ DQ(W_q [K, N]) + DQ(b_q int32)`` on an input with leading dims ``lead``."""
    weight = RNG.integers(-127, 128, (K, N)).astype(np.int8)
    w_scale = (RNG.random(N) * 0.02 + 0.005).astype(np.float32)
    x_scale = np.float32(0.03)
    inits = [
        numpy_helper.from_array(x_scale, "x_scale"), numpy_helper.from_array(np.uint8(120), "x_zp"),
        numpy_helper.from_array(weight, "w_q"), numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(N, np.int8), "w_zp"),
        numpy_helper.from_array(RNG.integers(-500, 500, N).astype(np.int32), "b_q"),
        numpy_helper.from_array((x_scale * w_scale).astype(np.float32), "b_scale"),
        numpy_helper.from_array(np.float32(0.04), "y_scale"), numpy_helper.from_array(np.uint8(128), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], axis=1),
        helper.make_node("MatMul", ["xd", "w"], ["mm"]),
    ]
    out = "mm"
    if bias:
        nodes += [helper.make_node("DequantizeLinear", ["b_q", "b_scale"], ["b"], axis=0),
                  helper.make_node("Add", ["mm", "b"], ["lin"])]
        out = "lin"
    if output_q:
        nodes += [helper.make_node("QuantizeLinear", [out, "y_scale", "y_zp"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zp"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, N])], inits,
        value_info=[helper.make_tensor_value_info("xq", TensorProto.UINT8, [*lead, K])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


LEADS = {  # symbolic / static leading dims -> concrete leading shapes to run
    "batch_seq_symbolic": (["b", "s"], [[2, 3], [1, 7]]),
    "batch_symbolic_rank4": (["b", 3, "h"], [[2, 3, 5], [1, 3, 1]]),
    "batch_symbolic_seq_static": (["b", 5], [[2, 5], [4, 5]]),
}


@pytest.mark.parametrize("output_q", [True, False])
@pytest.mark.parametrize("lead_name", list(LEADS))
def test_rewrite_is_value_identical_for_any_leading_shape(tmp_path: Path, lead_name: str, output_q: bool) -> None:
    lead, concrete_leads = LEADS[lead_name]
    model = _linear_graph(lead, True, output_q)
    rewritten, ops = _rewrite_checked(model, expected_rewrites=1)
    assert ops["Gemm"] == 1 and ops["MatMul"] == 0 and ops["Add"] == 0
    symbolic = sum(isinstance(d, str) for d in lead)
    assert ops["Shape"] == (1 if symbolic > 1 else 0)  # leading sizes read at run time only when 2+ are symbolic
    for concrete in concrete_leads:
        x = RNG.standard_normal([*concrete, K]).astype(np.float32) * 2
        (before,) = run(model, {"x": x})
        (after,) = run(rewritten, {"x": x})
        (after_optimized,) = run(rewritten, {"x": x}, optimize=True)
        (before_optimized,) = run(model, {"x": x}, optimize=True)
        assert after.shape == before.shape == (*concrete, N)
        np.testing.assert_array_equal(after, before)
        if output_q:  # onnxruntime's integer QGemm: the same step grid as its MatMul path, within one step
            np.testing.assert_allclose(after_optimized, before_optimized, rtol=0, atol=0.04 + 1e-6)
    if output_q:
        assert fusion_report(save(rewritten, tmp_path / "m.onnx")).integer_compute == {"QGemm": 1}
    assert_idempotent(rewritten, RULE)


@pytest.mark.parametrize("output_q", [True, False])
def test_linears_without_bias_keep_matmul_without_a_reason(tmp_path: Path, output_q: bool) -> None:
    """No bias to fuse: onnxruntime runs DQ -> MatMul -> Q as QLinearMatMul (DQ -> MatMul as MatMulIntegerToFloat)
    on the 3-D input as it is; the reshapes of a Gemm would only add kernels (hf-llama: 26 more, 1.08x -> 1.02x
    quantize_static's latency)."""
    model = _linear_graph(["b", "s"], False, output_q)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    report = apply(rewritten, [RULE, CollapseReshapes()])
    assert not report.counts.get(RULE.name) and not report.skipped
    assert rewritten.SerializeToString() == model.SerializeToString()
    fused = "QLinearMatMul" if output_q else "MatMulIntegerToFloat"
    assert fusion_report(save(rewritten, tmp_path / "m.onnx")).integer_compute == {fused: 1}


def _replace_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    next(t for t in model.graph.initializer if t.name == name).CopyFrom(numpy_helper.from_array(value, name))


def test_rank2_linears_are_left_alone_without_a_reason() -> None:
    model = _linear_graph(["b"], bias=True, output_q=True)  # rank 2: the exporter would have written Gemm
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [])
    assert model.SerializeToString() == before


def test_16_bit_and_blocked_weights_are_left_alone_with_their_reasons() -> None:
    model = _linear_graph(["b", 4], bias=True, output_q=True)
    weight = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "w_q")
    _replace_initializer(model, "w_q", weight.astype(np.int16))  # a 16-bit weight: not a QGemm operand
    _replace_initializer(model, "w_zp", np.zeros(N, np.int16))
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, ["weight is int16 (QGemm takes int8 / uint8 weights)"])
    assert model.SerializeToString() == before

    blocked = _linear_graph(["b", 4], bias=True, output_q=True)
    dequantize = next(n for n in blocked.graph.node if n.output[0] == "w")
    dequantize.attribute.extend([helper.make_attribute("block_size", 8)])
    dequantize.attribute[0].i = 0  # blocks along K: scale and zero point [K / 8, N]
    _replace_initializer(blocked, "w_scale", np.full((K // 8, N), 0.01, np.float32))
    _replace_initializer(blocked, "w_zp", np.zeros((K // 8, N), np.int8))
    x = RNG.standard_normal([2, 4, K]).astype(np.float32)
    expected = run(blocked, {"x": x})[0]
    assert apply_rule(blocked, RULE) == (0, ["weight is per-block"])
    np.testing.assert_array_equal(run(blocked, {"x": x})[0], expected)


def _two_layer_graph() -> onnx.ModelProto:
    """``x [b, s, K]`` (+ an int64 ``mask [b, s]`` input): q = lin_q(x), k = lin_k(x), y = lin_2(q), all uint8 QDQ.

    The shape of a transformer block with two symbolic leading dims: linears sharing an input, a linear chained
    onto another, and a graph input whose shape is the leading sizes.
    """
    inits = [numpy_helper.from_array(np.float32(0.03), "x_scale"), numpy_helper.from_array(np.uint8(120), "x_zp"),
             numpy_helper.from_array(np.float32(0.05), "h_scale"), numpy_helper.from_array(np.uint8(128), "h_zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"])]

    def linear(name: str, source: str, k: int, out: str) -> None:
        inits.extend([numpy_helper.from_array(RNG.integers(-127, 128, (k, N)).astype(np.int8), f"{name}_w"),
                      numpy_helper.from_array((RNG.random(N) * 0.02 + 0.005).astype(np.float32), f"{name}_ws"),
                      numpy_helper.from_array(np.zeros(N, np.int8), f"{name}_wzp"),
                      numpy_helper.from_array(RNG.integers(-500, 500, N).astype(np.int32), f"{name}_b"),
                      numpy_helper.from_array((RNG.random(N) * 1e-3).astype(np.float32), f"{name}_bs")])
        nodes.extend([
            helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wzp"], [f"{name}_wd"], axis=1),
            helper.make_node("MatMul", [source, f"{name}_wd"], [f"{name}_mm"]),
            helper.make_node("DequantizeLinear", [f"{name}_b", f"{name}_bs"], [f"{name}_bd"], axis=0),
            helper.make_node("Add", [f"{name}_mm", f"{name}_bd"], [f"{name}_lin"]),
            helper.make_node("QuantizeLinear", [f"{name}_lin", "h_scale", "h_zp"], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", "h_scale", "h_zp"], [out]),
        ])

    linear("lin_q", "xd", K, "q")
    linear("lin_k", "xd", K, "k")
    linear("lin_2", "q", N, "y")
    nodes.append(helper.make_node("Identity", ["mask"], ["mask_out"]))
    graph = helper.make_graph(
        nodes, "two_layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K]),
         helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "s", N]) for name in ("y", "k")]
        + [helper.make_tensor_value_info("mask_out", TensorProto.INT64, ["b", "s"])], inits,
        value_info=[helper.make_tensor_value_info("xq", TensorProto.UINT8, ["b", "s", K]),
                    helper.make_tensor_value_info("lin_q_q", TensorProto.UINT8, ["b", "s", N])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_two_symbolic_leading_dims_read_one_shape_of_the_input_that_has_them_and_stay_value_identical() -> None:
    """With ``[b, s]`` symbolic, the output shapes come from one ``Shape(mask)`` and one ``Concat`` per width.

    Before: one ``Shape(x_q) -> Concat`` per linear (3 + 3 nodes), and the ``Shape`` reader on ``lin_2``'s input
    kept ``lin_q``'s restoring ``Reshape`` alive. Now: 1 ``Shape`` + 1 ``Concat`` (every width is N), and
    ``collapse_reshapes`` drops ``lin_q``'s unflatten (``q`` flows into ``lin_2`` as 2-D rows).
    """
    model = _two_layer_graph()
    rewritten, ops = _rewrite_checked(model, expected_rewrites=3)
    assert ops["Gemm"] == 3 and ops["MatMul"] == 0
    assert ops["Shape"] == 1 and ops["Concat"] == 1
    (shape,) = (n for n in rewritten.graph.node if n.op_type == "Shape")
    assert list(shape.input) == ["mask"]
    # flatten(xq) shared by lin_q / lin_k; lin_q's unflatten collapsed into lin_2's flatten; lin_k, lin_2 unflatten
    assert ops["Reshape"] == 3
    for b, s in ((2, 3), (1, 7), (3, 1)):
        feeds = {"x": RNG.standard_normal([b, s, K]).astype(np.float32) * 2, "mask": np.ones((b, s), np.int64)}
        before, after = run(model, feeds), run(rewritten, feeds)
        for expected, got in zip(before, after, strict=True):
            assert got.shape == expected.shape
            np.testing.assert_array_equal(got, expected)
    assert_idempotent(rewritten, RULE)


def test_without_an_input_of_the_leading_sizes_the_first_linears_shape_is_shared_and_values_stay_identical() -> None:
    """GPT-Neo's ``[batch, Min(64, sequence)]`` is the shape of no graph input: the first linear's
    ``Shape(x_q, end=-1)`` serves the later linears with the same leading sizes (was one ``Shape`` and one
    ``Concat`` per linear: 3 + 3 nodes)."""
    model = _two_layer_graph()
    mask = next(v for v in model.graph.input if v.name == "mask")
    mask.type.tensor_type.shape.dim[1].dim_param = "t"  # the mask's length is not x's
    next(v for v in model.graph.output if v.name == "mask_out").type.tensor_type.shape.dim[1].dim_param = "t"
    rewritten, ops = _rewrite_checked(model, expected_rewrites=3)
    assert ops["Gemm"] == 3 and ops["Shape"] == 1 and ops["Concat"] == 1
    (shape,) = (n for n in rewritten.graph.node if n.op_type == "Shape")
    assert list(shape.input) == ["xq"]
    for b, s in ((2, 3), (1, 7), (3, 1)):
        feeds = {"x": RNG.standard_normal([b, s, K]).astype(np.float32) * 2, "mask": np.ones((b, s + 1), np.int64)}
        for expected, got in zip(run(model, feeds), run(rewritten, feeds), strict=True):
            assert got.shape == expected.shape
            np.testing.assert_array_equal(got, expected)
    assert_idempotent(rewritten, RULE)
