"""Per-channel activation specs through value-moving ops: requantized at a mover that moves channels (rule 5).

Before: conv -> flatten -> linear with a per-channel activation spec (axis 1) shared the conv's quantizer across the
flatten and failed at calibration with "qparam shape changed from (8,) to (288,)".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.quantization.spec import PerChannel, PerTensor, QuantizationSpec


class _ConvHead(nn.Module):
    """conv(3 -> 8) -> relu -> ``move`` -> linear(288 -> 4) on [N, 3, 8, 8] inputs."""

    def __init__(self, move: str) -> None:
        super().__init__()
        self.conv, self.fc, self.move = nn.Conv2d(3, 8, 3), nn.Linear(8 * 6 * 6, 4), move

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        if self.move == "channels_last":
            y = y.permute(0, 2, 3, 1)  # moves the channel axis: axis 1 is now H
        elif self.move == "swap_hw":
            y = y.permute(0, 1, 3, 2)  # keeps the channel axis in place
        return self.fc(torch.flatten(y, 1))


def _config(axis: int) -> co.QuantizerConfig:
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", granularity=PerChannel(axis=axis),
                            qparams_calculator="global_minmax")
    return co.QuantizerConfig.presets.w8a8().set_global(activation=spec)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(3)]


def _activation_scale_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(m.calculator.scale.shape) for name, m in model.named_modules()
            if name.endswith("output_fq") and hasattr(m, "calculator")}


@pytest.mark.parametrize(("move", "expected"), [
    # flatten of [4, 8, 6, 6]: the linear's input is requantized per feature (288) after the conv's 8 channels
    ("none", {"relu_output_fq": (8,), "flatten_output_fq": (288,), "fc_output_fq": (4,)}),
    # the permute moves the channels; the flatten after it is one group with it: the linear's edge is split off
    ("channels_last", {"relu_output_fq": (8,), "flatten_output_fq": (288,), "fc_output_fq": (4,)}),
    # a permute keeping axis 1 shares the conv's quantizer, as a per-tensor spec would
    ("swap_hw", {"relu_output_fq": (8,), "flatten_output_fq": (288,), "fc_output_fq": (4,)}),
])
def test_a_per_channel_activation_is_requantized_after_a_flatten_and_the_export_verifies(
        move: str, expected: dict[str, tuple[int, ...]], tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model, data = _ConvHead(move).eval(), _batches()
    prepared = co.prepare(model, _config(1), (data[0],))
    co.calibrate(prepared, data, progress=False)
    assert _activation_scale_shapes(prepared) == expected
    converted = co.convert(prepared)
    with torch.no_grad():
        reference = model(data[1])
        quantized = converted(data[1])
    assert (quantized - reference).abs().max() < 0.05 * reference.abs().max()
    path = co.export_onnx(converted, (data[0],), tmp_path / "m.onnx")
    report = co.verify_onnx(converted, path, (data[1],))
    assert report.ok, report


def test_a_permute_that_keeps_the_channel_axis_shares_one_quantizer_on_both_sides() -> None:
    model, data = _ConvHead("swap_hw").eval(), _batches()
    prepared = co.prepare(model, _config(1), (data[0],))
    permutes = [n for n in prepared.graph.nodes if n.target in (torch.permute, "permute")
                or "permute" in str(n.target)]
    assert len(permutes) == 1
    (permute,) = permutes
    (before,) = permute.all_input_nodes
    (after,) = permute.users
    assert before.op == after.op == "call_module" and before.target == after.target == "relu_output_fq"


def test_a_permute_that_moves_the_channel_axis_leaves_the_conv_quantizer_before_it() -> None:
    model, data = _ConvHead("channels_last").eval(), _batches()
    prepared = co.prepare(model, _config(1), (data[0],))
    (permute,) = [n for n in prepared.graph.nodes if "permute" in str(n.target)]
    (before,) = permute.all_input_nodes
    assert before.target == "relu_output_fq"
    assert all(u.op != "call_module" or u.target != "relu_output_fq" for u in permute.users)


class _BatchToChannels(nn.Module):
    """conv -> relu -> permute(1, 0, 2, 3) -> sigmoid: the sigmoid's axis 1 is the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.relu(self.conv(x)).permute(1, 0, 2, 3))


def test_a_permute_that_moves_the_batch_onto_the_channel_axis_is_refused_naming_the_permute_and_its_line() -> None:
    data = _batches()
    with pytest.raises(CoreaiOptValueError, match=(
            r"activation quantizer 'permute\.output' is per_channel along axis 1, whose size follows the batch size "
            r"\(4 in the example\) \(the value-moving op 'permute' \(.*permute.*\) at .*test_mover_requantization"
            r"\.py:\d+: return torch\.sigmoid\(torch\.relu\(self\.conv\(x\)\)\.permute\(1, 0, 2, 3\)\) moved the "
            r"batch axis there\).*Fix: quantize along a fixed-size axis")):
        co.prepare(_BatchToChannels().eval(), _config(1), (data[0],))


def test_a_per_tensor_activation_still_shares_one_quantizer_across_the_flatten() -> None:
    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", granularity=PerTensor())
    data = _batches()
    prepared = co.prepare(_ConvHead("none").eval(), co.QuantizerConfig.presets.w8a8().set_global(activation=spec),
                          (data[0],))
    (flatten,) = [n for n in prepared.graph.nodes if "flatten" in str(n.target)]
    (after,) = flatten.users
    assert after.target == "relu_output_fq"  # the exit call of the shared quantizer, no requantization
