"""When torch's dynamo exporter fails to decompose a graph, export_onnx retries with the TorchScript exporter.

The failure is injected with torch's own ``ConversionError`` and the message torch 2.13 gives for the T5 encoder
(``Cannot view a tensor ...``), so these tests do not depend on which real graphs still hit that exporter bug.
"""

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.onnx._internal.exporter._errors import ConversionError

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as onnx_export
from coreai_opt.onnx.export.export_routes import ExportRouteError, UntranslatableOpError, failure_site

_T5_FAILURE = (
    "Failed to decompose the FX graph for ONNX compatibility. This is step 2/3 of exporting the model to ONNX.\n"
    "## Exception summary\n\n<class 'ValueError'>: Cannot view a tensor with shape torch.Size([2, 16, 4, 16]) and "
    "strides (1024, 16, 256, 1) as a tensor with shape (2, 16, 64)!\n\n"
    "While executing %view_4 : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = "
    "(%transpose_3, [2, 16, -1]), kwargs = {})\nOriginal traceback:\n"
    'File "/models/t5.py", line 368, in forward\n    attn_output = attn_output.reshape(*input_shape, -1)\n'
)


def _fail_like_torch(*args: object) -> object:
    """Raise what torch 2.13 raises for the T5 encoder: a ConversionError caused by the ValueError."""
    cause = ValueError("Cannot view a tensor with shape torch.Size([2, 16, 4, 16]) and strides (1024, 16, 256, 1) "
                       "as a tensor with shape (2, 16, 64)!")
    raise ConversionError(_T5_FAILURE) from cause


def _converted(config: co.QuantizerConfig) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    prepared = co.prepare(model, config, (x,))
    co.calibrate(prepared, [torch.randn(4, 16) for _ in range(3)], progress=False)
    return co.convert(prepared), x


def test_failure_site_names_the_op_and_the_model_line():
    assert failure_site(ConversionError(_T5_FAILURE)) == (
        "op torch.ops.aten.view.default (from /models/t5.py:368: attn_output = attn_output.reshape(*input_shape, -1))")


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_sym", "w8"])
def test_torchscript_route_runs_warns_and_matches_the_dynamo_file(preset, tmp_path, monkeypatch):
    converted, x = _converted(getattr(co.QuantizerConfig.presets, preset)())
    dynamo_path = co.export_onnx(converted, (x,), tmp_path / "dynamo.onnx")
    monkeypatch.setattr(onnx_export, "_dynamo_export", _fail_like_torch)
    with pytest.warns(UserWarning, match=r"failed decomposing op torch\.ops\.aten\.view\.default \(from "
                                         r"/models/t5\.py:368.*exported the model with the TorchScript exporter"):
        ts_path = co.export_onnx(converted, (x,), tmp_path / "torchscript.onnx")
    report = co.verify_onnx(converted, ts_path, [torch.randn(7, 16)])
    assert report.ok, report
    feed = {"input": torch.randn(5, 16).numpy()}
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feed)[0]
            for p in (dynamo_path, ts_path)]
    np.testing.assert_array_equal(outs[0], outs[1])
    kernels = [co.fusion_report(p).num_integer_compute for p in (dynamo_path, ts_path)]
    assert kernels[1] == kernels[0] >= (2 if preset == "w8a8" else 0)


class _BatchReadAsANumber(nn.Module):
    """Builds a tensor from the batch size: ``torch.export`` keeps it symbolic (a ``sym_size`` node), the TorchScript
    tracer receives it as a Python int and records a constant (hf XLNet's relative attention, batch 2 baked in)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.ones(x.shape[0], 4)


def test_a_torchscript_file_that_cannot_run_at_another_batch_is_an_error_not_a_file_that_claims_it(tmp_path,
                                                                                                     monkeypatch):
    # before: the file declared input dimension 0 as "batch" and failed in onnxruntime at any batch but 4
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    prepared = co.prepare(_BatchReadAsANumber().eval(), co.QuantizerConfig.presets.w8a8(), (x,), capture="export")
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    monkeypatch.setattr(onnx_export, "_dynamo_export", _fail_like_torch)
    with pytest.warns(UserWarning, match="TorchScript exporter"), \
            pytest.raises(ValueError, match=r"dimension 0 \('batch'\) of input 'x' was exported as the constant 4.*"
                                            r"dynamic_batch=False"):
        co.export_onnx(converted, (x,), tmp_path / "m.onnx")
    with pytest.warns(UserWarning, match="TorchScript exporter"):
        path = co.export_onnx(converted, (x,), tmp_path / "m.onnx", dynamic_batch=False)
    assert co.verify_onnx(converted, path, [x]).ok


def test_when_every_route_fails_the_error_names_op_line_and_both_routes(tmp_path, monkeypatch):
    converted, x = _converted(co.QuantizerConfig.presets.w4())
    monkeypatch.setattr(onnx_export, "_dynamo_export", _fail_like_torch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ExportRouteError, match=r"Route 1, torch\.onnx\.export\(dynamo=True\), failed decomposing "
                                                   r"op torch\.ops\.aten\.view\.default \(from /models/t5\.py:368.*"
                                                   r"Cannot view.*Route 2, the TorchScript exporter.*opset") as info:
            co.export_onnx(converted, (x,), tmp_path / "m.onnx")
    assert isinstance(info.value, RuntimeError)
    assert not (tmp_path / "m.onnx").exists()


def test_other_exporter_failures_are_not_retried(tmp_path, monkeypatch):
    converted, x = _converted(co.QuantizerConfig.presets.w8a8())

    def crash(*args: object) -> object:
        raise ConversionError("Failed to export the model with torch.export. This is step 1/3")
    monkeypatch.setattr(onnx_export, "_dynamo_export", crash)
    with pytest.raises(Exception, match="step 1/3") as info:
        co.export_onnx(converted, (x,), tmp_path / "m.onnx")
    assert not isinstance(info.value, ExportRouteError)


class _ComplexRotation(nn.Module):
    """A linear, then a complex-valued product (as complex rotary embeddings): ``view_as_complex`` -> ``unsqueeze``
    on the complex tensor, which torch 2.13's exporter has no ONNX function for."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.freqs = nn.Buffer(torch.polar(torch.ones(4), torch.arange(4.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.view_as_complex(self.proj(x).reshape(x.shape[0], 4, 2))
        rotated = c.unsqueeze(1) * self.freqs
        return torch.view_as_real(rotated).flatten(1)


def test_an_op_torch_cannot_translate_is_an_error_of_ours_naming_op_cause_and_line(tmp_path):
    from coreai_opt.errors import CoreaiOptError
    from coreai_opt.onnx.export.export_routes import UntranslatableOpError

    torch.manual_seed(0)
    model = _ComplexRotation().eval()
    x = torch.randn(4, 8)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    with pytest.raises(UntranslatableOpError) as caught:
        co.export_onnx(converted, (x,), tmp_path / "complex.onnx")
    message = str(caught.value)
    assert isinstance(caught.value, CoreaiOptError) and isinstance(caught.value, ExportRouteError)
    assert message.startswith("torch.onnx.export cannot translate op aten.unsqueeze.default (from ")
    assert "test_export_routes.py:" in message  # the model's own line, from the node's stack-trace metadata
    assert ": rotated = c.unsqueeze(1) * self.freqs) to ONNX: " in message
    assert "No decompositions registered for the complex-valued input" in message
    assert "Fix: compute that part in real arithmetic" in message
    assert "coreai_opt bug" not in message and "Traceback" not in message and "step 3/3" not in message
    assert type(caught.value.__cause__).__name__ == "ConversionError"  # torch's error stays chained


@torch.library.custom_op("coreai_opt_test::scaled_sum", mutates_args=())
def _scaled_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w.t()).sum(-1, keepdim=True) * 0.5


@_scaled_sum.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], 1)


class _CustomOpHead(nn.Module):
    """A linear, then a library's custom op (as transformers' grouped expert matmul), opaque to the exporter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.coreai_opt_test.scaled_sum(self.proj(x), self.head)


def test_a_custom_op_without_onnx_function_is_an_error_of_ours_naming_its_library(tmp_path):
    from coreai_opt.onnx.export.export_routes import UntranslatableOpError

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    prepared = co.prepare(_CustomOpHead().eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    with pytest.raises(UntranslatableOpError) as caught:
        co.export_onnx(co.convert(prepared), (x,), tmp_path / "custom.onnx")
    message = str(caught.value)
    assert message.startswith("torch.onnx.export cannot translate op coreai_opt_test.scaled_sum.default (from ")
    assert "return torch.ops.coreai_opt_test.scaled_sum(self.proj(x), self.head)) to ONNX: it is a custom op of " \
           "'coreai_opt_test', which torch's exporter cannot look inside and has no ONNX function for." in message
    assert "Fix: choose coreai_opt_test's plain-PyTorch implementation" in message


def test_a_torchscript_file_too_large_to_probe_warns_that_its_axes_were_not_run(monkeypatch):
    from coreai_opt.onnx.export import axes_probe

    converted, x = _converted(co.QuantizerConfig.presets.w8a8())
    model = onnx_export.torchscript_export(converted, (x,), 18, [{0: "batch"}], ["input"], ["output"])
    assert axes_probe.axes_baked_in(model, (x,), [{0: "batch"}], ["input"]) == []  # runs at batch 5: symbolic
    monkeypatch.setattr(axes_probe, "_PROBE_MAX_BYTES", 10)
    with pytest.warns(UserWarning, match=r"too large .* to run once per symbolic axis \(batch\)"):
        assert axes_probe.axes_baked_in(model, (x,), [{0: "batch"}], ["input"]) == []


class _SizeAsNumber(nn.Module):
    """timm mvitv2's relative positions in miniature: a spatial size the capture keeps symbolic, used as a number."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        positions = torch.arange(y.shape[-1])[:, None] * max(y.shape[-1] / 4, 1.0)
        return y + positions.to(y.dtype).sum()


def test_a_symbolic_size_used_as_a_number_exports_with_the_unrequested_axes_fixed(tmp_path):
    # before: UntranslatableOpError on aten.mul.Scalar ("float() argument must be ... not 'SymbolicTensor'") while
    # torch's own float export of the model (static shapes) succeeded
    x = torch.randn(2, 3, 8, 8)
    prepared = co.prepare(_SizeAsNumber().eval(), co.QuantizerConfig.presets.w8a8(), (x,), capture="export")
    co.calibrate(prepared, [x, torch.randn(2, 3, 8, 8)], progress=False)
    converted = co.convert(prepared)
    with pytest.warns(UserWarning, match=r"dimension 3 \('width'\) of input 'x' is fixed at 8"):
        path = co.export_onnx(converted, (x,), tmp_path / "m.onnx")
    assert co.verify_onnx(converted, path, [torch.randn(5, 3, 8, 8)]).ok  # the batch stays dynamic
    with pytest.raises(UntranslatableOpError, match="aten.mul.Scalar"):  # asked for: the error stands
        co.export_onnx(converted, (x,), tmp_path / "w.onnx", dynamic_shapes={"x": {0: "batch", 3: "width"}})
