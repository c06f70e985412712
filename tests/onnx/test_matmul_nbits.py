"""The MatMulNBits export rule: weight-only linears run in onnxruntime as the accuracy level the model asked for.

Rewritten graphs are checked with numbers (eager vs onnxruntime), non-matching graphs with their reason, and a
second run of the rule changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.rewrite.matmul_nbits_weight import INT8_EMULATED_SUFFIX
from coreai_opt.onnx.rewrite.rules.write_matmul_nbits import UnconsumedInt8ComputeError, write_matmul_nbits
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation


class _TwoLinears(nn.Module):
    """A 3-D linear (exported as MatMul) and a 2-D one (exported as Gemm)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(96, 64)
        self.b = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).mean(1))


def _export(preset: str, directory: Path, **options: object) -> tuple[nn.Module, Path, torch.Tensor]:
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    x = torch.randn(4, 6, 96)
    config = QuantizerConfig.presets.get(preset)(**options)
    prepared = coreai_opt.prepare(model, config, (x,))
    coreai_opt.calibrate(prepared, [torch.randn(4, 6, 96) for _ in range(2)], progress=False)
    converted = coreai_opt.convert(prepared)
    return converted, export_onnx(converted, (x,), directory / f"{preset}.onnx"), torch.randn(8, 6, 96)


def _nbits(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]


def _ort(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize(("preset", "options", "bits", "block"),
                         [("w8", {}, 8, 128), ("w4", {"block_size": 32, "algorithm": "rtn"}, 4, 32),
                          ("w8a16", {}, 8, 128)])
def test_weight_only_linear_is_written_as_float_matmul_nbits_and_equals_eager(preset: str, options: dict, bits: int,
                                                                              block: int, tmp_path: Path) -> None:
    model, path, x = _export(preset, tmp_path, **options)
    nodes = _nbits(path)  # the 3-D linear (MatMul) and the 2-D one (Gemm, transB = 1)
    assert len(nodes) == 2 and all({a.name: a.i for a in n.attribute}["accuracy_level"] == 1 for n in nodes)
    (node,) = [n for n in nodes if {a.name: a.i for a in n.attribute}["K"] == 96]
    attrs = {a.name: a.i for a in node.attribute}
    assert (attrs["accuracy_level"], attrs["bits"], attrs["block_size"], attrs["K"], attrs["N"]) == (1, bits, block,
                                                                                                     96, 64)
    assert not node.name.endswith(INT8_EMULATED_SUFFIX)
    assert not {"MatMul", "Gemm"} & {n.op_type for n in onnx.load(str(path)).graph.node}
    eager = model(x).detach().numpy()
    assert np.abs(_ort(path, x) - eager).max() <= 1e-5 * (eager.max() - eager.min())
    assert verify_onnx(model, path, x).ok


@pytest.mark.parametrize(("preset", "options"), [("w8", {}), ("w4", {"block_size": 32, "algorithm": "rtn"})])
def test_int8_compute_writes_accuracy_level_4_for_both_linears_and_eager_emulates_it(preset: str, options: dict,
                                                                                     tmp_path: Path) -> None:
    model, path, x = _export(preset, tmp_path, compute="int8", **options)
    nodes = _nbits(path)
    assert len(nodes) == 2 and all(n.name.endswith(INT8_EMULATED_SUFFIX) for n in nodes)  # MatMul and Gemm
    assert {a.i for n in nodes for a in n.attribute if a.name == "accuracy_level"} == {4}
    assert {o.domain for o in onnx.load(str(path)).opset_import} == {"", "com.microsoft"}  # no marker domain left
    emulators = [m for m in model.modules() if isinstance(m, Int8ComputeActivation)]
    assert [m.block_size for m in emulators] == [128 if preset == "w8" else 32, 64 if preset == "w8" else 32]
    # both sides quantize the same activations (bit-exact emulation); the second linear's input comes out of a
    # float layer that may differ by an ulp, which can flip one int8 step there: allowed per output element,
    # one step of that row's input (amax / 127) times the largest |weight| of the output (w4: measured 4.7e-4,
    # one flip; w8: 3e-7)
    seen: list[torch.Tensor] = []
    handle = emulators[1].register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach()))
    eager = model(x).detach().numpy()
    handle.remove()
    got = _ort(path, x)
    step = seen[0].abs().amax(-1, keepdim=True) / 127  # K = 64 <= block: one block per row
    w_b = model.get_submodule("b_weight_fq")(
        model.get_parameter("b.weight")).detach()
    one_step = (step * w_b.abs().amax(-1)).numpy()
    assert (np.abs(got - eager) <= one_step + 1e-5 * (eager.max() - eager.min())).all()
    for m in emulators:
        m.forward = lambda t: t  # type: ignore[method-assign]  # the eager model without the emulation
    plain = model(x).detach().numpy()
    assert np.abs(got - plain).mean() > 10 * np.abs(got - eager).mean()  # w4: 7.0e-4 vs 3.9e-5 (one flipped row)
    del emulators[0].forward, emulators[1].forward
    report = verify_onnx(model, path, x)
    assert report.ok and report.outputs[0].rule == "int8 compute"


def test_matmul_compute_export_option_refuses_a_model_quantized_for_the_other_compute(tmp_path: Path) -> None:
    model, _, x = _export("w8", tmp_path)
    with pytest.raises(ValueError, match=r"matmul_compute='int8'.*presets.w8\(compute='int8'\)"):
        export_onnx(model, (x,), tmp_path / "m.onnx", matmul_compute="int8")
    int8_model, _, _ = _export("w8", tmp_path, compute="int8")
    with pytest.raises(ValueError, match="a.int8_compute"):
        export_onnx(int8_model, (x,), tmp_path / "m.onnx", matmul_compute="float")
    assert export_onnx(int8_model, (x,), tmp_path / "ok.onnx", matmul_compute="int8").exists()
    assert not (tmp_path / "m.onnx").exists()


def test_w8a8_linears_are_not_candidates_and_keep_their_bytes(tmp_path: Path) -> None:
    model, path, x = _export("w8a8", tmp_path)
    proto = onnx.load(str(path))
    assert not _nbits(path) and "com.microsoft" not in {o.domain for o in proto.opset_import}
    assert write_matmul_nbits(proto) == (0, [])


def _dq_matmul_model(block: int, weight_type: int = TensorProto.INT4, marker: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    k, n = 64, 16
    q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], axis=0, block_size=block)]
    a = "x"
    if marker:
        nodes.insert(0, helper.make_node("Int8ComputeActivation", ["x"], ["x_i8"], domain="coreai_opt",
                                         block_size=block))
        a = "x_i8"
    nodes.append(helper.make_node("MatMul", [a, "w"], ["y"], name="mm"))
    inits = [helper.make_tensor("w_q", weight_type, [k, n], q.reshape(-1).tolist()),
             numpy_helper.from_array((rng.random((k // block, n)) * 0.1 + 0.01).astype(np.float32), "w_s")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], inits)
    opsets = [helper.make_opsetid("", 21)] + ([helper.make_opsetid("coreai_opt", 1)] if marker else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_near_misses_name_the_check_and_leave_the_graph_unchanged() -> None:
    model = _dq_matmul_model(8)
    before = model.SerializeToString()
    assert write_matmul_nbits(model) == (0, [("mm", "block size 8 is not a power of two >= 16")])
    assert model.SerializeToString() == before
    int16 = _dq_matmul_model(16, TensorProto.INT16)
    assert write_matmul_nbits(int16)[1] == [("mm", "weight type INT16 has no MatMulNBits form (int4 / uint4 / int8 "
                                                    "/ uint8)")]


def test_rewritten_graph_matches_the_dequantize_matmul_and_a_second_run_changes_nothing() -> None:
    model = _dq_matmul_model(32)
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                     sess_options=_no_fusion()).run(None, {"x": x})[0]
    assert write_matmul_nbits(model) == (1, [])
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(got - reference).max() <= 1e-5
    once = model.SerializeToString()
    assert write_matmul_nbits(model) == (0, []) and model.SerializeToString() == once


def _no_fusion() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def test_an_int8_compute_linear_that_cannot_be_written_fails_the_export_naming_it_and_the_reason() -> None:
    with pytest.raises(UnconsumedInt8ComputeError, match=r"mm \(MatMul\): block size 8 is not a power of two"):
        write_matmul_nbits(_dq_matmul_model(8, marker=True))
    assert write_matmul_nbits(_dq_matmul_model(32, marker=True))[0] == 1


class _Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: weight stored ``[in, out]``, computed as ``addmm(b, x, W)`` (exported as a ``Gemm``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.1)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return flat.view(*x.shape[:-1], self.weight.shape[1])


def test_weight_only_conv1d_addmm_is_written_as_matmul_nbits_and_equals_eager(tmp_path: Path) -> None:
    # Before: DequantizeLinear + Gemm, which onnxruntime fuses differently from eager (a Conv1D + Linear model: max
    # |diff| 1.1e-3 against an allowed 5.6e-5; now 3e-8).
    torch.manual_seed(0)
    model = nn.Sequential(_Conv1D(64, 48), nn.ReLU(), _Conv1D(48, 32)).eval()
    x = torch.randn(2, 5, 64)
    prepared = coreai_opt.prepare(model, QuantizerConfig.presets.w4(block_size=16, algorithm="rtn"), (x,))
    coreai_opt.calibrate(prepared, [(x,)], progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, (x,), tmp_path / "conv1d.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulNBits") == 2 and not {"Gemm", "DequantizeLinear"} & set(ops)
    shapes = sorted(tuple(a.i for a in n.attribute if a.name in ("K", "N")) for n in _nbits(path))
    assert shapes == [(48, 32), (64, 48)]
    test = torch.randn(3, 7, 64)
    eager = converted(test).detach().numpy()
    assert np.abs(_ort(path, test) - eager).max() <= 1e-5 * (eager.max() - eager.min())
    assert verify_onnx(converted, path, test).ok


def test_gemm_with_weight_in_out_layout_and_bias_becomes_matmul_nbits_plus_add_equal_to_the_dq_gemm() -> None:
    rng = np.random.default_rng(0)
    k, n, block = 64, 16, 32
    q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], axis=0, block_size=block),
             helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm")]
    inits = [helper.make_tensor("w_q", TensorProto.INT4, [k, n], q.reshape(-1).tolist()),
             numpy_helper.from_array((rng.random((k // block, n)) * 0.1 + 0.01).astype(np.float32), "w_s"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    x = rng.standard_normal((2, k)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                     sess_options=_no_fusion()).run(None, {"x": x})[0]
    assert write_matmul_nbits(model) == (1, [])
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits", "Add"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(got - reference).max() <= 1e-5
