"""Graph-side inputs that used to fail with bare or misleading errors now get coreai_opt's own error (or work).

Before: ``return y, None`` -> "the model must return a tensor or a (nested) tuple of tensors, got tuple"; a NaN
weight -> "2 activation quantizer(s) were never calibrated"; a per-channel activation spec on the batch axis ->
accepted, then ``RuntimeError: The size of tensor a (2) must match ...`` on the next batch size; uint4/int4
activations on a conv -> a file onnxruntime refused (``INVALID_GRAPH ... QLinearConv``).
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.quantization.spec import PerChannel, PerTensor, QuantizationSpec

from .conftest import cnn_batches, make_small_cnn, ort_run

W8A8 = co.QuantizerConfig.presets.w8a8


class _ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(x), None


def test_a_none_output_is_named_by_its_position_at_export(tmp_path) -> None:  # noqa: ANN001
    data = [torch.randn(2, 4) for _ in range(2)]
    prepared = co.prepare(_ReturnsNone().eval(), W8A8(), (data[0],))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    assert converted(data[0])[1] is None  # torch use is unaffected
    with pytest.raises(TypeError, match=r"^output\[1\] of the model is None \(NoneType\), and an ONNX graph returns "
                                        r"only tensors; return only tensors from forward"):
        co.export_onnx(converted, (data[0],), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize(("where", "index", "value", "named"), [
    ("conv1.weight", (1, 2, 0, 1), float("nan"), r"parameter 'conv1\.weight' holds 1 NaN of 216 values \(first at "
                                                 r"index \(1, 2, 0, 1\)\)"),
    ("conv1.weight", (0, 0, 0, 0), float("inf"), r"parameter 'conv1\.weight' holds 1 Inf of 216 values"),
    ("bn1.running_var", (3,), float("nan"), r"buffer 'bn1\.running_var' holds 1 NaN of 8 values \(first at index "
                                            r"\(3,\)\)"),
])
def test_a_non_finite_weight_is_named_at_prepare_instead_of_blaming_calibration(
        where: str, index: tuple[int, ...], value: float, named: str) -> None:
    model = make_small_cnn()
    with torch.no_grad():
        tensor = model.get_parameter(where) if where.endswith("weight") else model.get_buffer(where)
        tensor[index] = value
    with pytest.raises(ValueError, match=rf"^prepare: {named}.*can never be calibrated\. Fix: reload or repair"):
        co.prepare(model, W8A8(), (cnn_batches()[0],))


def test_an_inf_in_a_buffer_is_accepted() -> None:
    """Attention masks hold -inf on purpose."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.0, 0.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.fc(x) + self.mask, -1)

    co.prepare(Masked().eval(), W8A8(), (torch.randn(2, 4),))


def test_weights_that_became_nan_after_training_are_named_at_convert(cnn_pipeline) -> None:  # noqa: ANN001
    prepared = co.prepare(make_small_cnn(), W8A8(), (cnn_pipeline.example,))
    co.calibrate(prepared, cnn_pipeline.data, progress=False)
    with torch.no_grad():
        prepared.get_parameter("fc.weight")[0, 0] = float("nan")  # e.g. QAT diverged
    with pytest.raises(ValueError, match=r"^convert: parameter 'fc\.weight' holds 1 NaN .*Fix: restore weights"):
        co.convert(prepared)


def _per_channel_activation(axis: int) -> co.QuantizerConfig:
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", granularity=PerChannel(axis=axis),
                            qparams_calculator="global_minmax")
    return W8A8().set_global(activation=spec)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_per_channel_activation_spec_on_the_batch_axis_is_refused_at_prepare(capture: str) -> None:
    with pytest.raises(ValueError, match=r"activation quantizer 'x\.input' is per_channel along axis 0, whose size "
                                         r"follows the batch size \((4|symbolic) in the example\).*axis=1.*PerTensor"):
        co.prepare(make_small_cnn(), _per_channel_activation(0), (cnn_batches()[0],), capture=capture)


def test_a_per_channel_activation_spec_on_the_channel_axis_still_works() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    data = cnn_batches()
    prepared = co.prepare(model, _per_channel_activation(1), (data[0],))
    co.calibrate(prepared, [*data, torch.randn(2, 3, 8, 8)], progress=False)
    assert co.convert(prepared)(torch.randn(7, 3, 8, 8)).shape == (7, 4, 4, 4)


@pytest.mark.parametrize("dtype", ["uint4", "int4"])
def test_four_bit_activations_on_convs_export_a_file_onnxruntime_runs_bit_exactly(dtype: str, tmp_path) -> None:  # noqa: ANN001
    act = QuantizationSpec(dtype=dtype, qscheme="asymmetric", granularity=PerTensor(),
                           qparams_calculator="global_minmax")
    data = cnn_batches()
    prepared = co.prepare(make_small_cnn(), W8A8().set_global(activation=act), (data[0],))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (data[0],), tmp_path / "m.onnx")
    optimized = ort_run(path, data[0])[0]  # default session: all graph optimisations on
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    unoptimized = session.run(None, {session.get_inputs()[0].name: data[0].numpy()})[0]
    assert (optimized == unoptimized).all()  # the guards change nothing the optimizer may not reproduce
    step = float(converted.get_submodule("fc_output_fq").calculator.scale)
    with torch.no_grad():
        assert abs(optimized - converted(data[0]).numpy()).max() <= step * 1.001  # float conv rounding: <= 1 step
    guards = [n for n in onnx.load(path).graph.node if n.op_type == "Max" and n.name.endswith("_guard")]
    assert len(guards) >= 4
