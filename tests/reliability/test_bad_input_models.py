"""Awkward models: train mode for PTQ, control flow, a submodule called twice, tied parameters, fp16/bf16 models and
models moved to another device.

No GPU exists on CI, so device handling is tested with the ``meta`` device: a converted model moved with ``.to()``
must carry every quantizer tensor along (no tensor created on a fixed device), which is what a CUDA model needs.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.passes import CaptureError

W8A8 = co.QuantizerConfig.presets.w8a8


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def test_ptq_of_a_model_in_train_mode_runs_in_eval_mode_and_leaves_the_model_untouched() -> None:
    torch.manual_seed(0)
    model = _BNNet().train()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = [torch.randn(5, 6) for _ in range(3)]
    prepared = co.prepare(model, W8A8(), (data[0],))
    assert not prepared.training
    again = copy.deepcopy(prepared)
    co.calibrate(prepared, data, progress=False)
    co.calibrate(again, data, progress=False)
    # Dropout off and BatchNorm statistics frozen: calibration is repeatable and the user's BN buffers are unchanged.
    pairs = zip(prepared.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs)  # specs: dicts
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    converted = co.convert(prepared)
    reference = copy.deepcopy(model).eval()(data[0])
    assert torch.allclose(converted(data[0]), reference, atol=0.1), "PTQ must use the BatchNorm running statistics"


class _ShapeBranch(nn.Module):
    """``if x.dim() == 4`` cannot be traced by FX (a Proxy in control flow) but torch.export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.mean(dim=1)
        return self.fc(x)


def test_control_flow_fx_cannot_trace_falls_back_to_export() -> None:
    torch.manual_seed(0)
    model = _ShapeBranch().eval()
    x = torch.randn(2, 5, 4)
    prepared = co.prepare(model, W8A8(), (x,))
    assert prepared.meta["coreai_opt"]["capture"] == "export"
    co.calibrate(prepared, [x, torch.randn(3, 5, 4)], progress=False)
    converted = co.convert(prepared)
    assert torch.allclose(converted(x), model(x), atol=0.05)
    with pytest.raises(CaptureError, match=r"FX tracing failed in '_ShapeBranch\.forward' at "
                                           r".*test_bad_input_models\.py:\d+: if x\.dim\(\) == 3:") as info:
        co.prepare(model, W8A8(), (x,), capture="fx")
    assert "Add the module to leaf_modules or pass concrete_args" in str(info.value)


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        repeats = int(x.abs().sum().item()) % 3 + 1  # data-dependent Python int: neither FX nor export can capture
        return x.repeat(1, repeats)[:, :4]


class _Uncapturable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = _DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc(x))


def test_model_neither_capture_can_handle_raises_naming_module_and_line() -> None:
    line = inspect.getsourcelines(_DataDependent.forward)[1] + 1
    with pytest.raises(CaptureError, match=rf"cannot capture _Uncapturable: FX tracing failed in module 'inner' "
                                           rf"\(_DataDependent\) at .*test_bad_input_models\.py:{line}: ") as info:
        co.prepare(_Uncapturable(), W8A8(), (torch.randn(2, 4),))
    message = str(info.value)
    assert re.search(rf"torch\.export failed at .*test_bad_input_models\.py:{line}: repeats = int", message)
    assert "Fix: mark the offending module as a leaf (leaf_modules=[...])" in message


def test_leaf_modules_is_the_documented_way_around_uncapturable_code() -> None:
    torch.manual_seed(0)
    model = _Uncapturable().eval()
    x = torch.randn(2, 4)
    prepared = co.prepare(model, W8A8(), (x,), leaf_modules=[_DataDependent])
    assert prepared.meta["coreai_opt"]["capture"] == "fx"
    co.calibrate(prepared, [x], progress=False)
    assert torch.allclose(co.convert(prepared)(x), model(x), atol=0.05)


class _CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + self.act(self.fc(10.0 * x))


def test_submodule_called_twice_gets_one_activation_quantizer_per_call_site() -> None:
    torch.manual_seed(0)
    model = _CalledTwice().eval()
    x = torch.randn(16, 4)
    prepared = co.prepare(model, W8A8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    by_name = {fq.name: fq for _, fq in fake_quantizers(prepared)}
    assert {"act.output", "act[1].output", "fc.weight", "fc[1].weight"} <= set(by_name)
    with torch.no_grad():
        expected = [float(model.act(model.fc(x)).max()) / 255, float(model.act(model.fc(10.0 * x)).max()) / 255]
    got = [float(by_name["act.output"].calculator.scale), float(by_name["act[1].output"].calculator.scale)]
    assert got == pytest.approx(expected, rel=0.01), "each call site keeps its own range"
    assert torch.equal(by_name["fc.weight"].calculator.scale, by_name["fc[1].weight"].calculator.scale)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_shared_parameters_stay_shared_and_get_identical_weight_qparams(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = _Tied().eval()
    x = torch.randn(8, 4)
    prepared = co.prepare(model, W8A8(), (x,))
    assert prepared.a.weight is prepared.b.weight, "the copy keeps the tie"
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    by_name = {fq.name: fq for _, fq in fake_quantizers(converted)}
    assert torch.equal(by_name["a.weight"].calculator.scale, by_name["b.weight"].calculator.scale)
    path = co.export_onnx(converted, (x,), tmp_path / "tied.onnx")
    report = co.verify_onnx(converted, path, [x])
    assert report.ok and report.max_abs_diff <= float(by_name["b.output"].calculator.scale) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_quantizes_with_float32_qparams(dtype: torch.dtype) -> None:
    """fp16/bf16 models: qparams stay float32, the op runs in float32 and casts back (documented in fake_quantize)."""
    torch.manual_seed(0)
    model32 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    model = copy.deepcopy(model32).to(dtype)
    x = torch.randn(16, 4)
    prepared = co.prepare(model, W8A8(), (x.to(dtype),))
    co.calibrate(prepared, [x.to(dtype)], progress=False)
    converted = co.convert(prepared)
    for _, fq in fake_quantizers(converted):
        assert fq.calculator.scale.dtype == torch.float32, fq.name
    y = converted(x.to(dtype))
    assert y.dtype == dtype
    out_scale = float(converted.get_submodule("_2_output_fq").calculator.scale)
    assert torch.allclose(y.float(), model32(x), atol=4 * out_scale + 0.05)


def test_half_precision_model_exports_and_matches_onnxruntime(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval().half()
    x = torch.randn(16, 4).half()
    prepared = co.prepare(model, W8A8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    report = co.verify_onnx(converted, co.export_onnx(converted, (x,), tmp_path / "fp16.onnx"), [x])
    assert report.ok, str(report)


def test_converted_model_moves_to_another_device_with_all_quantizer_state(converted_copy: torch.fx.GraphModule,
                                                                         cnn_pipeline) -> None:  # noqa: ANN001
    moved = converted_copy.to("meta")
    for name, tensor in [*moved.named_buffers(), *moved.named_parameters()]:
        assert tensor.device.type == "meta", f"{name} stayed on {tensor.device}"
    out = moved(cnn_pipeline.example.to("meta"))
    assert out.device.type == "meta" and tuple(out.shape) == (4, 10)


def test_saved_qparams_load_onto_the_device_of_the_model(cnn_pipeline) -> None:  # noqa: ANN001
    state = copy.deepcopy(cnn_pipeline.prepared).to("meta").state_dict()
    fresh = co.prepare(cnn_pipeline.model, W8A8(), (cnn_pipeline.example,))
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # not the quantizer specs (dicts)
    fresh.load_state_dict(state | {k: torch.empty_like(v, device="cpu") for k, v in tensors.items()}, strict=True)
    loaded = {k: v for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert {k: tuple(v.shape) for k, v in loaded.items()} == {k: tuple(v.shape) for k, v in tensors.items()}


def test_bfloat16_model_export_is_refused_with_the_fix(tmp_path) -> None:  # noqa: ANN001
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval().to(torch.bfloat16)
    x = torch.randn(16, 4).to(torch.bfloat16)
    prepared = co.prepare(model, W8A8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    with pytest.raises(ValueError, match=r"bfloat16.*no bfloat16 Conv/Gemm/MatMul kernels.*model.float\(\)"):
        co.export_onnx(co.convert(prepared), (x,), tmp_path / "bf16.onnx")
    assert not (tmp_path / "bf16.onnx").exists()
