import copy
import re
import warnings

import pytest
import torch
from torch import nn

from coreai_opt.api import calibrate, convert, enable_observers, prepare, summary
from coreai_opt.config import QuantizerConfig
from coreai_opt.config.quantizer_config import OpConfig
from coreai_opt.graph.graph_meta import GraphMeta, InputSpec, OutputLeaf, get_graph_meta
from coreai_opt.passes.capture import CaptureError
from coreai_opt.quantization.spec import QuantizationSpec
from tests.zoo import PRESETS, ZOO, build, preset_config, weighted_layer_count

# Where w8a8 puts its quantizers (op kind of the tensor each quantizer serves: a weight/bias counts for its
# layer, a relu/relu6 output holds the fused conv/add output quantizer). A layer / group norm, GELU or SiLU whose
# neighbours run in float (the encoders' final norm before a mean over the sequence, conv1d_groupnorm's GroupNorm
# before its 3-D SiLU) has none: onnxruntime runs it in float either way (float_only_ops.NO_INTEGER_KERNEL).
#  resnet18: 20 conv weights + 20 int32 biases + 11 conv outputs not followed by relu (8 conv2 + 3 downsample),
#            17 relu outputs (stem + 2 per block), 1 input, pooled output, fc weight/bias/output.
W8A8_COUNTS = {
    "resnet18": {"input": 1, "conv": 51, "relu": 17, "avg_pool": 1, "linear": 3},
    "mobilenet_v2": {"input": 1, "conv": 122, "relu6": 34, "add": 11, "hardswish": 1, "avg_pool": 1, "linear": 3},
    "conv_transpose_decoder": {"input": 1, "conv": 11, "relu": 5, "cat": 1, "conv_transpose": 2},
    "transformer_encoder": {"embedding": 2, "parameter": 1, "add": 5, "layer_norm": 4, "linear": 37, "matmul": 4,
                            "softmax": 2, "gelu": 2, "avg_pool": 1},
    # nn.TransformerEncoderLayer calls SDPA: decomposed, each layer quantizes q, k, q·kᵀ, the scaled scores (the
    # packed in_proj keeps the scale from folding), the softmax output, v and p·v
    "torch_transformer": {"linear": 25, "input": 1, "matmul": 4, "mul": 2, "softmax": 2, "add": 4, "layer_norm": 3,
                          "relu": 2, "avg_pool": 1},
    "shape_unpack": {"linear": 7, "input": 1, "div": 1, "avg_pool": 1},
    "conv1d_groupnorm": {"input": 1, "conv": 6, "silu": 2, "avg_pool": 1, "linear": 3},
}
WEIGHT_ONLY = ("w8", "w4")


def _sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - test).pow(2).sum()))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(ZOO))
def test_prepare_calibrate_convert_runs_for_every_zoo_model_and_preset(name, preset):
    model, example, batches = build(name)
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        reference = model(batches[0])
    prepared = prepare(model, preset_config(preset, model), example)
    assert prepared.meta["coreai_opt"]["capture"] == ZOO[name].capture
    calibrate(prepared, batches[:2], progress=False)
    converted = convert(prepared)
    assert converted.meta["coreai_opt"]["converted"] is True and prepared.meta["coreai_opt"]["converted"] is False
    report = summary(converted)
    weights = report.counts("weight")
    assert sum(weights.values()) == weighted_layer_count(model)
    activations = sum(report.counts("activation").values())
    assert (activations == 0) == (preset in WEIGHT_ONLY)
    if preset == "w8a8":
        assert report.counts() == W8A8_COUNTS[name]
    enable_observers(prepared, False)
    with torch.no_grad():
        out = converted(batches[0])
        assert torch.equal(out, prepared(batches[0]))
        assert torch.equal(model(batches[0]), reference)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    sqnr = _sqnr(reference, out)
    print(f"{name} {preset}: SQNR {sqnr:.1f} dB, {len(report.quantizers)} quantizers")
    if preset == "w8a8" and ZOO[name].is_cnn:
        assert sqnr >= 25.0


def test_prepare_rejects_non_tuple_example_inputs():
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple.*\(x,\)"):
        prepare(nn.Linear(2, 2), QuantizerConfig.presets.w8(), torch.randn(1, 2))


def test_prepare_rejects_dict_config_and_unknown_config_key():
    with pytest.raises(TypeError, match="QuantizerConfig.from_dict"):
        prepare(nn.Linear(2, 2), {"weight": None}, (torch.randn(1, 2),))
    with pytest.raises(ValueError, match="weigth"):
        QuantizerConfig.from_dict({"weigth": None})


def test_prepare_warns_when_module_name_regex_matches_nothing():
    model, example, _ = build("conv1d_groupnorm")
    cfg = QuantizerConfig.presets.w8a8().set_module_name(r"conv3", OpConfig(weight=None))
    with pytest.warns(UserWarning, match=r"\['conv3'\] match no module of Conv1dGroupNorm"):
        prepare(model, cfg, example)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(model, QuantizerConfig.presets.w8a8().set_module_name(r"conv1", OpConfig(weight=None)), example)


class _Uncapturable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        while x.norm() > 1:  # data-dependent loop: neither FX nor export can capture it
            x = self.fc(x) / 2
        return x


def test_prepare_names_source_line_of_uncapturable_model():
    with pytest.raises(CaptureError, match=r"test_prepare.py:\d+: while x.norm\(\) > 1.*leaf_modules"):
        prepare(_Uncapturable(), QuantizerConfig.presets.w8a8(), (torch.randn(2, 4),))


def test_prepare_rejects_a_dtype_mix_the_spec_forbids():
    with pytest.raises(ValueError, match=r"asymmetric.*float8.*qscheme='symmetric'"):
        QuantizationSpec(dtype="float8_e4m3fn", qscheme="asymmetric")


def test_prepare_rejects_block_size_that_does_not_divide_naming_the_module():
    model, example, _ = build("resnet18")
    config = QuantizerConfig.presets.w4(block_size=8)
    config.per_block_fallback = "error"
    with pytest.raises(ValueError, match=re.escape("stem.0 (conv2d) weight (8, 3, 7, 7)")):
        prepare(model, config, example)


def test_prepare_qat_starts_in_train_mode_with_observers_on():
    model, example, _ = build("conv1d_groupnorm")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example, qat=True)
    assert prepared.training and prepared.meta["coreai_opt"]["qat"] is True
    ptq = prepare(model, QuantizerConfig.presets.w8a8(), example)
    assert not ptq.training
    flags = {(bool(m.observer_enabled), bool(m.fake_quant_enabled)) for m in prepared.modules()
             if hasattr(m, "observer_enabled")}
    assert flags == {(True, True)}


def test_prepare_graph_meta_follows_the_contract():
    model, example, _ = build("transformer_encoder")
    cfg = QuantizerConfig.presets.w8a8()
    prepared = prepare(model, cfg, example)
    assert get_graph_meta(prepared) == GraphMeta(
        capture="fx", input_names=("tokens",), converted=False, qat=False,
        input_specs=(InputSpec("tokens", "int64", (2, 12)),), config=cfg.to_dict(),
        outputs=(OutputLeaf("", "Tensor"),))
    assert prepared.meta["coreai_opt"]["config"] == cfg.to_dict()  # dict-style reads keep working


def test_prepare_warns_when_a_train_mode_model_is_prepared_for_ptq():
    model, example, _ = build("conv1d_groupnorm")
    model.train()
    with pytest.warns(UserWarning, match=r"Conv1dGroupNorm is in train mode.*model.eval\(\).*qat=True"):
        prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    assert not prepared.training and model.training  # the user's model keeps its mode


def test_prepare_rejects_a_model_with_meta_tensors_naming_one():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"tensors on the 'meta' device \(e.g. '0.weight'\).*to_empty"):
        prepare(model.eval(), QuantizerConfig.presets.w8a8(), (torch.randn(1, 4),))
