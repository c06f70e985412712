"""Regressions for bugs the reliability suite found (one section per bug, each asserting type + message or values).

A. the int32 bias quantizer ran during calibration with a placeholder / stale input scale (not repeatable);
B. a state_dict saved under another spec loaded silently with ``strict=True``;
C. an extra positional input / unknown dict key in a calibration batch gave a raw TypeError;
D. a module called twice got two bias quantizers both named ``l.bias``;
E. ``annotate`` always suggested a block size, even for a per-channel axis error.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api import load_state_dict
from coreai_opt.api.internals.quantizer_state import bias_quantizers, fake_quantizers
from coreai_opt.config import OpConfig
from coreai_opt.errors import InputValidationError
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize, QuantizationSpec

from .conftest import Pipeline


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def _mlp_and_data() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _MLP().eval()
    with torch.no_grad():  # biases large enough that int32 rounding with a wrong scale (1.0) is visible
        model.fc1.bias.uniform_(-1.0, 1.0)
    return model, [torch.randn(32, 8) for _ in range(3)]


def _assert_state_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


# ---------------------------------------------------------------------------------------------- A: int32 bias
def test_bias_fake_quantize_flag_off_returns_the_bias_unchanged() -> None:
    bq = BiasFakeQuantize()
    bias = torch.tensor([0.26, -1.0])
    assert bq.fake_quant_enabled is True
    assert bq(bias, torch.tensor(0.1), torch.tensor([0.5, 0.25])).tolist() == [0.25, -1.0]
    bq.enable_fake_quant(False)
    assert bq(bias, torch.tensor(1.0), torch.tensor([0.5, 0.25])) is bias


def test_calibrating_twice_on_the_same_data_gives_an_identical_state_dict() -> None:
    model, data = _mlp_and_data()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],))
    assert bias_quantizers(prepared), "the preset quantizes biases to int32"
    co.calibrate(prepared, data, progress=False)
    first = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in prepared.state_dict().items()}
    co.calibrate(prepared, data, progress=False)
    _assert_state_equal(first, prepared.state_dict())
    # activation ranges are those of the float biases: identical to a model prepared without int32 biases
    config = co.QuantizerConfig.presets.w8a8().model_copy(update={"int32_bias": False})
    reference = co.calibrate(co.prepare(model, config, (data[0],)), data, progress=False)
    assert not bias_quantizers(reference)
    expected = {fq.name: fq.calculator for _, fq in fake_quantizers(reference)}
    for _, fq in fake_quantizers(prepared):
        assert torch.equal(fq.calculator.scale, expected[fq.name].scale), fq.name
        assert torch.equal(fq.calculator.zero_point, expected[fq.name].zero_point), fq.name
    assert all(bq.fake_quant_enabled for _, bq in bias_quantizers(prepared)), "calibrate restores the flag"


def test_enable_fake_quant_switches_bias_quantizers_and_convert_leaves_them_on() -> None:
    model, data = _mlp_and_data()
    prepared = co.calibrate(co.prepare(model, co.QuantizerConfig.presets.w8a8(), (data[0],)), data, progress=False)
    co.enable_fake_quant(prepared, False)
    assert [bq.fake_quant_enabled for _, bq in bias_quantizers(prepared)] == [False, False]
    co.enable_observers(prepared, False)
    with torch.no_grad():
        assert torch.equal(prepared(data[1]), model(data[1])), "fake quant off everywhere = the float model"
    converted = co.convert(prepared)
    assert [bq.fake_quant_enabled for _, bq in bias_quantizers(converted)] == [True, True]
    co.enable_fake_quant(prepared, True)
    with torch.no_grad():
        assert torch.equal(converted(data[1]), prepared(data[1])), "converted == prepared with observers off"


# ---------------------------------------------------------------------------------------------- B: saved spec
def test_fake_quantize_state_saved_under_another_spec_raises_naming_both() -> None:
    saved = FakeQuantize(QuantizationSpec(dtype="int8", qscheme="asymmetric"))
    saved(torch.randn(16))
    current = FakeQuantize(QuantizationSpec(dtype="int8"))
    current.set_name("fc.output")
    assert saved.state_dict()["_extra_state"] == saved.spec.to_dict()
    message = ("fc.output: state was saved with int8 asymmetric per_tensor but this quantizer is int8 symmetric "
               "per_tensor; prepare with the config used when saving (prepared.meta['coreai_opt']['config'])")
    with pytest.raises(ValueError, match=re.escape(message)):
        current.load_state_dict(saved.state_dict(), strict=True)


def test_state_dict_of_w8a8_does_not_load_into_w8a8_sym(cnn_pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    torch.save(cnn_pipeline.prepared.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    other = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8_sym(), (cnn_pipeline.example,))
    with pytest.raises(ValueError, match=r"\.output: state was saved with uint8 asymmetric per_tensor but this "
                                         r"quantizer is int8 symmetric per_tensor; prepare with the config used"):
        other.load_state_dict(state, strict=True)
    with pytest.raises(ValueError, match=r"does not match this model's quantizers") as info:
        load_state_dict(other, state)
    message = str(info.value)
    assert "x.input (x_input_fq): uint8 asymmetric per_tensor → int8 symmetric per_tensor" in message
    assert "relu2.output (relu2_output_fq): uint8 asymmetric per_tensor → int8 symmetric per_tensor" in message
    assert "prepare with the config used when saving (prepared.meta['coreai_opt']['config'])" in message
    same = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    assert load_state_dict(same, state) is same
    assert torch.equal(co.convert(same)(cnn_pipeline.example), cnn_pipeline.converted(cnn_pipeline.example))


def test_load_state_dict_lists_missing_and_unexpected_quantizers(cnn_pipeline: Pipeline) -> None:
    state = cnn_pipeline.prepared.state_dict()
    config = co.QuantizerConfig.presets.w8a8().set_module_name("fc", OpConfig(activation=None))
    fewer = co.prepare(cnn_pipeline.model, config, (cnn_pipeline.example,))
    with pytest.raises(ValueError, match=r"\(1\):\n  fc_output_fq: uint8 asymmetric per_tensor → not in this model\n"):
        load_state_dict(fewer, state)
    partial = {k: v for k, v in state.items() if not k.startswith("x_input_fq.")}
    full = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    with pytest.raises(ValueError, match=r"x\.input \(x_input_fq\): missing from the state_dict → uint8 asymmetric"):
        load_state_dict(full, partial)


# ---------------------------------------------------------------------------------------------- C: batch arity
def test_calibrate_rejects_an_extra_positional_input_naming_the_inputs(cnn_pipeline: Pipeline) -> None:
    prepared = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    x = cnn_pipeline.example
    with pytest.raises(InputValidationError, match=re.escape(
            "calibration batch 0: 2 positional inputs given but the model takes 1 (x); pass one tensor per model "
            "input, in order, like the example inputs given to prepare")):
        co.calibrate(prepared, [(x, x)], progress=False)


def test_calibrate_rejects_an_unknown_dict_key_naming_the_inputs(cnn_pipeline: Pipeline) -> None:
    prepared = co.prepare(cnn_pipeline.model, co.QuantizerConfig.presets.w8a8(), (cnn_pipeline.example,))
    with pytest.raises(InputValidationError, match=re.escape(
            "calibration batch 0: unknown keyword input(s) 'image'; the model's inputs are x; use those names as "
            "keywords (dict keys)")):
        co.calibrate(prepared, [{"image": cnn_pipeline.example}], progress=False)


# ---------------------------------------------------------------------------------------------- D: bias names
class _CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)  # noqa: E741

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(torch.relu(self.l(x)))


def test_module_called_twice_gets_numbered_bias_quantizers() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    prepared = co.prepare(_CalledTwice().eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    assert [bq.name for _, bq in bias_quantizers(prepared)] == ["l.bias", "l[1].bias"]
    assert [path for path, _ in bias_quantizers(prepared)] == ["l_bias_fq", "l_1_bias_fq"]


# ---------------------------------------------------------------------------------------------- E: fix text
def _prepare_linear_weight(granularity: dict) -> None:
    spec = QuantizationSpec(dtype="int4" if granularity["type"] == "per_block" else "int8", granularity=granularity)
    config = co.QuantizerConfig.presets.w8a8().set_op_kind("linear", OpConfig(weight=spec))
    co.prepare(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4)), config, (torch.randn(2, 4),))


def test_axis_error_suggests_an_axis_not_a_block_size() -> None:
    with pytest.raises(ValueError, match=r"per-channel axis=3 is out of range") as info:
        _prepare_linear_weight({"type": "per_channel", "axis": 3})
    message = str(info.value)
    assert "\nFix: pick a granularity axis within the weight's rank (axis 0 = output channels), or override the " \
           "listed modules with config.set_module_name(" in message
    assert "block size" not in message.split("\nFix:")[1]


def test_block_size_error_still_suggests_a_block_size() -> None:
    with pytest.raises(ValueError, match=r"block_size=3 does not divide") as info:
        _prepare_linear_weight({"type": "per_block", "axis": 1, "block_size": 3})
    fix = str(info.value).split("\nFix:")[1]
    assert fix.startswith(" pick a block size that divides these dimensions (or set the config's "
                          "per_block_fallback='per_channel'), or override")
    assert "granularity axis" not in fix
