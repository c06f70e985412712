"""export_onnx on hand-built converted models (FakeQuantize modules frozen in export mode)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import coreai_opt as co
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.export import save as save_module
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.spec.granularity import PerBlock, PerTensor
from tests.onnx.qmodels import FLOAT8, ActivationAndWeight, QuantConv, QuantMLP, freeze, make_fq, power_of_two_scales

# One export per opset group: every (dtype, granularity, scheme) cell of a group lives in one model.
GROUPS: dict[str, dict[str, object]] = {
    "opset18": {
        "cells": [(d, g, s) for d in ("int8", "uint8") for g in ("per_tensor", "per_channel") for s in (None,)]
        + [("int8", "per_tensor", "symmetric_with_clipping"), ("int8", "per_channel", "symmetric_with_clipping")],
        "opset": 18, "dynamic_batch": True,
    },
    "opset19": {
        "cells": [(d, g, None) for d in FLOAT8 for g in ("per_tensor", "per_channel")],
        "opset": 19, "dynamic_batch": True,
    },
    "opset21": {
        "cells": [(d, g, None) for d in ("int16", "uint16", "int4", "uint4") for g in ("per_tensor", "per_channel")]
        + [("int4", "per_channel", "symmetric_with_clipping"), ("int16", "per_tensor", "symmetric_with_clipping")],
        "opset": 21, "dynamic_batch": True,
    },
    "blocked": {  # per-block activations have a batch-shaped scale: static batch
        "cells": [(d, "per_block", None) for d in ("int8", "uint8", "int16", "uint16", "int4", "uint4", *FLOAT8)]
        + [("int4", "per_block", "symmetric_with_clipping")],
        "opset": 21, "dynamic_batch": False,
    },
}
CELLS = [(group, cell) for group, spec in GROUPS.items() for cell in spec["cells"]]  # type: ignore[union-attr]


class CellBank(nn.Module):
    """One ActivationAndWeight per cell; returns all their outputs in order."""

    def __init__(self, cells: list[tuple[str, str, str | None]]) -> None:
        super().__init__()
        self.cells = nn.ModuleList(ActivationAndWeight(*cell) for cell in cells)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out for cell in self.cells for out in cell(x))


@pytest.fixture(scope="module")
def exported_groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("groups")
    result = {}
    for name, spec in GROUPS.items():
        model = freeze(CellBank(spec["cells"]), torch.randn(4, 8, 64) * 2)  # type: ignore[arg-type]
        path = export_onnx(model, torch.randn(4, 8, 64), directory / f"{name}.onnx",
                           dynamic_batch=bool(spec["dynamic_batch"]))
        result[name] = (model, path)
    return result


@pytest.mark.parametrize(("group", "cell"), CELLS, ids=[f"{c[0]}-{c[1]}-{c[2] or 'default'}" for _, c in CELLS])
def test_export_onnx_is_bit_exact_per_quantizer(exported_groups: dict[str, tuple[nn.Module, Path]], group: str,
                                                cell: tuple[str, str, str | None]) -> None:
    """Activation Q/DQ and the folded weight DQ reproduce eager fake-quant bit for bit (incl. ties, clamping)."""
    model, path = exported_groups[group]
    index = GROUPS[group]["cells"].index(cell)  # type: ignore[union-attr]
    x = torch.randn(4, 8, 64) * 3
    x[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 0.5])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run([f"output_{2 * index}", f"output_{2 * index + 1}"], {"x": x.numpy()})
    with torch.no_grad():
        expected = model.cells[index](x)
    np.testing.assert_array_equal(got[0], expected[0].numpy())
    np.testing.assert_array_equal(got[1], expected[1].numpy())


@pytest.mark.parametrize("group", list(GROUPS))
def test_export_onnx_uses_lowest_opset_and_stores_weights_quantized(
    exported_groups: dict[str, tuple[nn.Module, Path]], group: str
) -> None:
    _, path = exported_groups[group]
    proto = onnx.load(str(path))
    assert {o.domain: o.version for o in proto.opset_import}[""] == GROUPS[group]["opset"]
    num_cells = len(GROUPS[group]["cells"])  # type: ignore[arg-type]
    float_weights = [t.name for t in proto.graph.initializer if t.name.endswith("weight")]
    assert float_weights == []
    quantized = [t for t in proto.graph.initializer if t.name.endswith("weight_quantized")]
    assert len(quantized) == num_cells
    assert all(t.data_type != onnx.TensorProto.FLOAT for t in quantized)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == num_cells  # activations only: weight Q folded
    weight_dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized")]
    users = [u.op_type for dq in weight_dqs for u in proto.graph.node if dq.output[0] in u.input]
    assert users == ["Add"] * num_cells  # narrow-range clamps were moved into the stored integers
    assert {e.key for n in proto.graph.node for e in n.metadata_props} == {"namespace"}  # no stack traces


def test_export_onnx_conv_with_folded_weight_and_int32_bias_is_bit_exact(tmp_path: Path) -> None:
    """Power-of-two scales make every float sum exact, so ORT (QLinearConv) must equal eager exactly."""
    torch.manual_seed(1)
    model = power_of_two_scales(freeze(QuantConv(), torch.randn(8, 4, 12, 12)))
    path = export_onnx(model, torch.randn(2, 4, 12, 12), tmp_path / "conv.onnx")
    proto = onnx.load(str(path))
    inits = {t.name: t for t in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    (conv,) = [n for n in proto.graph.node if n.op_type == "Conv"]
    weight_dq, bias_dq = producer[conv.input[1]], producer[conv.input[2]]
    assert (weight_dq.op_type, bias_dq.op_type) == ("DequantizeLinear", "DequantizeLinear")
    assert weight_dq.input[0] == "conv.weight_quantized"
    assert inits["conv.weight_quantized"].data_type == onnx.TensorProto.INT8
    assert inits[bias_dq.input[0]].data_type == onnx.TensorProto.INT32
    bias_scale = numpy_helper.to_array(inits[bias_dq.input[1]])
    expected_scale = model.act_in.calculator.scale.numpy() * model.w_q.calculator.scale.numpy()
    np.testing.assert_array_equal(bias_scale, expected_scale)
    report = verify_onnx(model, path, [torch.randn(1, 4, 12, 12), torch.randn(5, 4, 12, 12) * 2])
    assert report.bit_exact, str(report)
    assert report.fusion.integer_compute == {"QLinearConv": 1}


def test_export_onnx_makes_batch_dynamic_by_default(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = freeze(QuantMLP(), torch.randn(32, 64))
    path = export_onnx(model, torch.randn(3, 64), tmp_path / "mlp.onnx")
    proto = onnx.load(str(path))
    assert [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == ["batch", 64]
    assert [d.dim_param or d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim] == ["batch", 10]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = torch.randn(batch, 64)
        (out,) = session.run(None, {"x": x.numpy()})
        assert out.shape == (batch, 10)


def test_export_onnx_keeps_batch_static_when_dynamic_batch_is_false(tmp_path: Path) -> None:
    model = freeze(QuantMLP(), torch.randn(32, 64))
    path = export_onnx(model, torch.randn(3, 64), tmp_path / "mlp.onnx", dynamic_batch=False,
                       input_names=["features"], output_names=["logits"])
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["features"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3


def test_export_onnx_names_inputs_after_arguments_and_numbers_multiple_outputs(tmp_path: Path) -> None:
    model = freeze(ActivationAndWeight("int8", "per_tensor"), torch.randn(2, 8, 64))
    path = export_onnx(model, torch.randn(2, 8, 64), tmp_path / "two.onnx")
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["x"]
    assert [o.name for o in proto.graph.output] == ["output_0", "output_1"]


def test_export_onnx_is_byte_identical_when_repeated(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = freeze(QuantMLP(weight_granularity=PerBlock(1, 16), weight_dtype="int4"), torch.randn(32, 64))
    first = export_onnx(model, torch.randn(2, 64), tmp_path / "a.onnx").read_bytes()
    second = export_onnx(model, torch.randn(2, 64), tmp_path / "b.onnx").read_bytes()
    assert first == second
    proto = onnx.load_from_string(first)
    assert {t.name: t.data_type for t in proto.graph.initializer}["fc1.weight_quantized"] == onnx.TensorProto.INT4


def test_export_onnx_writes_external_data_above_the_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save_module, "SINGLE_FILE_LIMIT_BYTES", 1000)
    torch.manual_seed(4)
    model = freeze(QuantMLP(), torch.randn(32, 64))
    path = export_onnx(model, torch.randn(2, 64), tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    proto = onnx.load(str(path), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"big.onnx.data"}
    report = verify_onnx(model, path, torch.randn(4, 64))
    assert report.ok, str(report)


class _Float(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_export_onnx_refuses_a_float_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no coreai_opt quantizers.*coreai_opt.convert"):
        export_onnx(_Float(), torch.randn(1, 4), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_refuses_quantizers_not_in_export_mode(tmp_path: Path) -> None:
    model = QuantMLP()
    message = r"5 quantizer\(s\) are not in export mode \('input'.*coreai_opt.convert\(prepared\)"
    with pytest.raises(ValueError, match=message):
        export_onnx(model, torch.randn(1, 64), tmp_path / "m.onnx")


def test_export_onnx_refuses_a_prepared_graph_module_not_marked_converted(tmp_path: Path) -> None:
    inner = freeze(QuantMLP(), torch.randn(8, 64))

    class KeepQuantizers(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, FakeQuantize) or super().is_leaf_module(m, qualname)

    gm = torch.fx.GraphModule(inner, KeepQuantizers().trace(inner))
    gm.meta["coreai_opt"] = {"capture": "fx", "converted": False, "input_names": ["x"], "config": {}}
    with pytest.raises(ValueError, match=r"prepared but not converted.*coreai_opt.convert\(prepared\)"):
        export_onnx(gm, torch.randn(1, 64), tmp_path / "m.onnx")
    gm.meta["coreai_opt"]["converted"] = True
    gm.meta["coreai_opt"]["input_names"] = ["pixels"]
    path = export_onnx(gm, torch.randn(1, 64), tmp_path / "m.onnx")
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["pixels"]


def test_export_onnx_refuses_non_modules_and_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="torch.nn.Module returned by coreai_opt.convert"):
        export_onnx(lambda x: x, torch.randn(1, 4), tmp_path / "m.onnx")  # type: ignore[arg-type]
    model = freeze(QuantMLP(), torch.randn(8, 64))
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple of tensors"):
        export_onnx(model, [[1.0]], tmp_path / "m.onnx")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the path before the example inputs"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(1, 64))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.nn.Module returned by coreai_opt.convert, got PosixPath"):
        export_onnx(tmp_path / "m.onnx", model, torch.randn(1, 64))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_names has 2 name"):
        export_onnx(model, torch.randn(1, 64), tmp_path / "m.onnx", output_names=["a", "b"])


def test_export_onnx_raises_for_too_low_opset_without_writing(tmp_path: Path) -> None:
    model = freeze(QuantMLP(weight_dtype="int4", weight_granularity=PerTensor()), torch.randn(8, 64))
    with pytest.raises(ValueError, match="opset=18 is too low for quantizer 'fc1.weight' .*'int4'.*>= 21"):
        export_onnx(model, torch.randn(1, 64), tmp_path / "m.onnx", opset=18)
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_refuses_missing_directory(tmp_path: Path) -> None:
    model = freeze(QuantMLP(), torch.randn(8, 64))
    with pytest.raises(FileNotFoundError, match=f"directory {tmp_path / 'missing'} does not exist"):
        export_onnx(model, torch.randn(1, 64), tmp_path / "missing" / "m.onnx")
    assert not (tmp_path / "missing").exists()


def test_export_onnx_keeps_existing_file_when_export_fails(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"keep me")

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = make_fq("int8", PerTensor())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.q(x)
            if torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
                raise RuntimeError("boom inside the exporter")
            return y

    model = freeze(Broken(), torch.randn(4, 4))
    with pytest.raises(Exception, match="boom inside the exporter"):
        export_onnx(model, torch.randn(2, 4), path)
    assert path.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_export_onnx_names_the_outputs_from_the_capture_record_without_running_the_model(tmp_path: Path) -> None:
    """GraphMeta.outputs (recorded at capture) replaces the eager forward export_onnx ran only to count outputs."""
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.fc(x))
            return h[:, :3], h[:, 3:]

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    prepared = co.prepare(TwoHeads().eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    eager_calls: list[type] = []

    def count(_module: nn.Module, args: tuple) -> None:
        if type(args[0]) is torch.Tensor and not isinstance(args[0], FakeTensor):
            eager_calls.append(type(args[0]))

    handles = [m.register_forward_pre_hook(count) for m in converted.modules() if isinstance(m, FakeQuantize)]
    assert handles  # every quantizer runs as a module in eager
    path = export_onnx(converted, (x,), tmp_path / "two.onnx")
    for handle in handles:
        handle.remove()
    assert eager_calls == []
    assert [o.name for o in onnx.load(str(path)).graph.output] == ["output_0", "output_1"]
    assert verify_onnx(converted, path, [x]).ok
