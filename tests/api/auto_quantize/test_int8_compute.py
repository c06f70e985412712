"""The ``int8_compute`` candidate: int8 per-block weights with onnxruntime's per-row, per-K-block int8 activations.

Checked with numbers: its kernel in the file (``MatMulNBits`` bits 8, accuracy_level 4) and eager vs onnxruntime
agreement, a config mixing every linear candidate exported with each layer on its kernel, its one-unit errors, the
search choosing it where the cost table makes it the fastest format within the bound, and a static producer
taking the option away from the linear reading its 8-bit output.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.algorithms.auto_quantize import recipe
from coreai_opt.api.algorithms.auto_quantize.candidates import candidate_op_config
from coreai_opt.api.algorithms.auto_quantize.output_error import model_outputs, relative_squared_error, unit_errors
from coreai_opt.api.algorithms.auto_quantize.search import Option
from coreai_opt.api.algorithms.auto_quantize.search_report import build_report
from coreai_opt.api.algorithms.auto_quantize.units import find_units, layer_int8_compute
from coreai_opt.onnx.verify.fusion_report import FLOAT_COMPUTE_OPS, INTEGER_COMPUTE_OPS, fusion_report, optimized_model
from coreai_opt.quantization.matmul_nbits.int8_compute import int8_compute_activation
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation
from tests.api.auto_quantize.conftest import table

#: dynamic fastest, int8_compute next, float slow; static and int16 no faster than float (so not measured)
DYNAMIC_THEN_INT8 = {"float": (1.0, 10.0), "dynamic": (0.0, 1e6), "int8_compute": (0.0, 1e5), "static": (1.0, 10.0),
                     "int16": (1.0, 10.0)}


class Mixed(nn.Module):
    """Four linears of distinct (in, out) shapes; none reads another linear's output directly."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(24)
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 32)
        self.c = nn.Linear(32, 48)
        self.d = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(self.ln(x)))
        h = torch.relu(self.b(h))
        return self.d(torch.tanh(self.c(h)))


class Chain(nn.Module):
    """``b`` reads ``a``'s output directly (a static ``a`` requantizes it to uint8)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 24)
        self.b = nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _config(choices: dict[str, str]) -> co.QuantizerConfig:
    config = co.QuantizerConfig(weight=None, activation=None)
    for name, choice in choices.items():
        config.set_module_name(re.escape(name), candidate_op_config(choice))
    return config


def _convert(model: nn.Module, config: co.QuantizerConfig, batches: list[torch.Tensor]) -> torch.fx.GraphModule:
    prepared = co.prepare(model, config, (batches[0],))
    co.calibrate(prepared, batches, progress=False)
    return co.convert(prepared)


def _kernels(path, shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Layer name -> the onnxruntime compute node running it, found by the (in, out) sizes of its weight."""
    graph = optimized_model(path).graph
    dims = {i.name: frozenset(i.dims) for i in graph.initializer if len(i.dims) == 2}
    by_shape = {frozenset(s): name for name, s in shapes.items()}
    out = {}
    for node in graph.node:
        if node.op_type not in INTEGER_COMPUTE_OPS | FLOAT_COMPUTE_OPS:
            continue
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            out[by_shape[frozenset((attrs["K"], attrs["N"]))]] = node.op_type
        else:
            (weight,) = [dims[i] for i in node.input if i in dims]
            out[by_shape[weight]] = node.op_type
    return out


@pytest.fixture(scope="module")
def mixed_data():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    return Mixed().eval(), [torch.randn(3, 7, 24, generator=generator) for _ in range(4)]


def test_int8_compute_exports_matmul_nbits_bits_8_accuracy_level_4_and_onnxruntime_matches_eager(mixed_data,
                                                                                                tmp_path):
    model, batches = mixed_data
    converted = _convert(model, _config(dict.fromkeys("abcd", "int8_compute")), batches)
    emulators = {m.name: m.block_size for m in converted.modules() if isinstance(m, Int8ComputeActivation)}
    assert emulators == {"a.int8_compute": 32, "b.int8_compute": 64, "c.int8_compute": 32, "d.int8_compute": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = co.export_onnx(converted, (batches[0],), tmp_path / "m.onnx")
    nodes = [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nodes]
    assert [(a["K"], a["N"], a["bits"], a["accuracy_level"], a["block_size"]) for a in attrs] == [
        (24, 40, 8, 4, 32), (40, 32, 8, 4, 64), (32, 48, 8, 4, 32), (48, 8, 8, 4, 64)]
    x = torch.randn(5, 7, 24, generator=torch.Generator().manual_seed(9))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        eager, plain = converted(x).numpy(), model(x).numpy()
    spread = float(eager.max() - eager.min())
    # eager emulates the kernel's activation quantization: onnxruntime is ~1e-7 of the range from it (float
    # accumulation order), while the int8 activations themselves move the output ~1e-3 of the range from float
    assert np.abs(got - eager).max() <= 1e-5 * spread
    assert np.abs(got - plain).mean() > 100 * np.abs(got - eager).mean()
    report = co.verify_onnx(converted, path, batches)
    assert report.ok and report.outputs[0].rule == "int8 compute"


def test_a_config_mixing_every_linear_candidate_exports_verifies_and_runs_each_layer_on_its_kernel(mixed_data,
                                                                                                  tmp_path):
    model, batches = mixed_data
    choices = {"a": "static", "b": "int8_compute", "c": "dynamic", "d": "float"}
    config = _config(choices)
    assert co.QuantizerConfig.from_yaml(config.to_yaml()) == config
    converted = _convert(model, config, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = co.export_onnx(converted, (batches[0],), tmp_path / "mixed.onnx")
    assert co.verify_onnx(converted, path, batches).ok
    kernels = _kernels(path, {"a": (24, 40), "b": (40, 32), "c": (32, 48), "d": (48, 8)})
    assert kernels["a"] == "QGemm" and kernels["b"] == "MatMulNBits" and kernels["c"] == "DynamicQuantizeMatMul"
    assert kernels["d"] in FLOAT_COMPUTE_OPS
    report = fusion_report(path)
    assert report.integer_compute == {"QGemm": 1, "MatMulNBits": 1, "DynamicQuantizeMatMul": 1}
    assert report.num_float_compute == 1


def test_unit_errors_of_int8_compute_switch_on_only_the_units_own_activation_quantization(mixed_data):
    model, batches = mixed_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        units = find_units(co.prepare(model, recipe._uniform_config("static"), (batches[0],)))
        prepared = co.prepare(model, recipe._uniform_config("int8_compute"), (batches[0],))
    references = model_outputs(model, batches)
    errors = unit_errors(prepared, units, batches, references, relative_squared_error)
    for unit, error in zip(units, errors, strict=True):  # the same model with only this unit in int8_compute
        alone = co.prepare(model, _config(dict.fromkeys(unit.names, "int8_compute")), (batches[0],))
        assert error == pytest.approx(relative_squared_error(model_outputs(alone, batches), references), rel=1e-9)
        assert error > 1e-7
    assert len(layer_int8_compute(prepared)) == 4  # the emulation modules are back in place
    assert all(isinstance(prepared.get_submodule(t), Int8ComputeActivation)
               for targets in layer_int8_compute(prepared).values() for t in targets)


def test_search_picks_int8_compute_where_dynamic_misses_the_bound_and_float_is_slow(tiny, tmp_path):
    model, batches = tiny
    runs = [co.auto_quantize(model, batches, (batches[0],), cost_table=table(DYNAMIC_THEN_INT8), max_error=2e-4,
                             smooth=False, progress=False) for _ in range(2)]
    report = runs[0].report
    assert [u.choice for u in report.units] == ["dynamic", "int8_compute", "dynamic"]  # q+k, fc1, fc2
    fc1 = report.units[1]
    # fc1 (after the LayerNorm's 20x outlier channel through q, k): dynamic 1.7e-4, int8_compute 6.5e-5 (measured)
    assert fc1.alternatives["int8_compute"][0] < 0.5 * fc1.alternatives["dynamic"][0]
    assert sum(u.alternatives["dynamic"][0] for u in report.units) > 2e-4 >= report.measured_error
    assert all(set(u.alternatives) == {"dynamic", "int8_compute", "float"} for u in report.units)
    assert "int8_compute err / µs" in report.table()
    # deterministic, and the config reproduces the converted model bit-exactly
    assert [u.choice for u in runs[1].report.units] == [u.choice for u in report.units]
    again = _convert(runs[0].model, runs[0].config, batches)
    state, expected = again.state_dict(), runs[0].converted.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) if isinstance(v, torch.Tensor) else v == expected[k]
               for k, v in state.items())
    with torch.no_grad():
        assert all(torch.equal(again(b), runs[0].converted(b)) for b in batches)
    assert co.QuantizerConfig.from_yaml(runs[0].config.to_yaml()) == runs[0].config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = [co.export_onnx(r.converted, (batches[0],), tmp_path / f"m{i}.onnx") for i, r in enumerate(runs)]
    assert files[0].read_bytes() == files[1].read_bytes()
    assert co.verify_onnx(runs[0].converted, files[0], batches).ok
    # q and k share one DynamicQuantizeLinear (onnxruntime: MatMulIntegerToFloat each), fc1 on MatMulNBits
    assert fusion_report(files[0]).integer_compute == {"MatMulIntegerToFloat": 2, "DynamicQuantizeMatMul": 1,
                                                       "MatMulNBits": 1}


def test_int8_compute_only_measures_against_the_float_model(tiny):
    model, batches = tiny
    lines = {"float": (1.0, 10.0), "int8_compute": (0.0, 1e5)}
    strict = co.auto_quantize(model, batches, (batches[0],), candidates=("int8_compute", "float"),
                              cost_table=table(lines | {"dynamic": (1.0, 10.0), "static": (1.0, 10.0),
                                                        "int16": (1.0, 10.0)}),
                              max_error=1e-12, smooth=False, progress=False)
    # every layer float: zero error, so the reference has no int8 activation emulation left on
    assert strict.report.counts() == {"float": 4} and strict.report.measured_error == 0.0


def test_int8_compute_behind_a_static_layer_loses_the_option_and_the_round_is_searched_again():
    torch.manual_seed(0)
    model = Chain().eval()
    batches = [torch.randn(4, 16) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        units = find_units(co.prepare(model, recipe._uniform_config("static"), (batches[0],)))
        assert [u.names for u in units] == [("a",), ("b",)]
        options = [{"static": Option(0.0, 1.0), "float": Option(0.0, 9.0)},
                   {"int8_compute": Option(0.0, 1.0), "static": Option(0.0, 2.0), "float": Option(0.0, 9.0)}]
        behind: list[int] = []
        candidates = list(co.api.algorithms.auto_quantize.CANDIDATES)
        choices, prepared, capped = recipe._assign_and_prepare(options, (1.0, None), candidates, units,
                                                               {}, behind, (model, (batches[0],), None, "auto"))
    # b as int8_compute would read a's uint8 output: no MatMulNBits, a float Gemm behind DequantizeLinear
    assert choices == ["static", "static"] and behind == [1] and "int8_compute" not in options[1] and not capped
    assert layer_int8_compute(prepared) == {}
    text = build_report(units, choices, options, {}, {}, table(), (1.0, None), 0.0, "x", "m", (), 0.0,
                        ("b",)).table()
    assert "int8_compute dropped for b: the input is a static layer's 8-bit output" in text


def test_the_cost_table_graph_of_int8_compute_is_the_exported_kernel_and_computes_its_numbers():
    from coreai_opt.api.algorithms.auto_quantize import cost_measurement as cm

    rng = np.random.default_rng(0)
    for (m, k, n), block in zip(cm.LINEAR_SHAPES, (32, 128, 256, 256, 256), strict=True):
        model, x, macs = cm._graph("linear_int8_compute", (m, k, n), rng)
        (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert {a.name: a.i for a in node.attribute} == {"K": k, "N": n, "bits": 8, "block_size": block,
                                                         "accuracy_level": 4}
        assert macs == m * k * n
        packed = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        weight = (packed["w_nb"].reshape(n, -1)[:, :k].astype(np.float32) - 128.0) * 0.01
        (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        a = int8_compute_activation(torch.from_numpy(x), block).numpy()
        exact = a.astype(np.float64) @ weight.astype(np.float64).T
        # the kernel quantizes x per row and block as the eager emulation does: float32 rounding away from it
        # (~1e-6 relative), where the unquantized x is ~1e-2 relative away
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
        assert np.abs(x.astype(np.float64) @ weight.T - exact).max() > 1e-3 * np.abs(exact).max()


class ScaledWeight(nn.Module):
    """A linear whose weight is computed in ``forward`` (nothing for ``MatMulNBits`` to store)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w * 2.0, self.b)


def test_a_model_int8_compute_cannot_hold_is_searched_without_it_and_the_report_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), ScaledWeight()).eval()
    batches = [torch.randn(4, 16) for _ in range(4)]
    lines = {"float": (1.0, 10.0), "static": (0.0, 1e6), "int8_compute": (0.0, 1e7), "dynamic": (1.0, 10.0),
             "int16": (1.0, 10.0)}
    result = co.auto_quantize(model, batches, (batches[0],), candidates=("static", "int8_compute", "float"),
                              cost_table=table(lines), max_error=1.0, smooth=False, progress=False)
    assert result.report.counts() == {"static": 2}
    assert all("int8_compute" not in u.alternatives for u in result.report.units)
    assert any(n.startswith("not measured: int8_compute (prepare refused it: 2: matmul_compute='int8' needs a 2-D "
                            "weight stored in the model") for n in result.report.notes)
