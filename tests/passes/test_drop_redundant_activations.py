import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coreai_opt.api import calibrate, convert, prepare
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig
from coreai_opt.config.quantizer_config import OpConfig
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.drop_redundant_activations import drop_redundant_activations
from coreai_opt.quantization.spec import QuantizationSpec


class _Acts(nn.Module):
    def __init__(self, top: float) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        # a tensor, not a number: a mul by a number requests no quantizer (float_only_ops), and these tests need
        # the mul's quantizer with relu6 fused into it
        self.register_buffer("top", torch.tensor(top))

    def forward(self, x):
        x = F.relu(self.a(x))
        x = F.relu6(self.b(x) * self.top)
        return F.hardtanh(self.c(x), 0.0, 2.0)


def _kinds(gm):
    return [get_meta(n).kind for n in gm.graph.nodes]


def _run(config, top):
    config.fold_channel_scales = False  # keep b(x) * top a mul (folded, relu6 would fuse into b's output instead)
    torch.manual_seed(0)
    model = _Acts(top).eval()
    prepared = prepare(model, config, (torch.randn(2, 8),))
    data = [torch.randn(32, 8) * 3 for _ in range(3)]
    calibrate(prepared, data, progress=False)
    return prepared, data


def test_drop_redundant_activations_removes_relu_exactly_for_asymmetric_uint8():
    prepared, data = _run(QuantizerConfig.presets.w8a8(), top=0.5)  # relu6 input small: range tops below 6
    converted = convert(prepared)  # runs drop_redundant_activations
    kinds = _kinds(converted)
    assert OpKind.RELU not in kinds and OpKind.RELU6 not in kinds and OpKind.HARDTANH not in kinds
    for _, fq in fake_quantizers(prepared):
        fq.enable_observer(False)
    for x in data:
        assert torch.equal(converted(x), prepared(x))


def test_drop_redundant_activations_keeps_relu6_when_range_exceeds_six():
    cfg = QuantizerConfig.presets.w8a8()
    wide = QuantizationSpec.from_dict({**cfg.activation.to_dict(), "float_range": [0.0, 8.0]})
    cfg.set_op_kind("mul", OpConfig(activation=wide))  # relu6 is fused into the mul before it: Q tops at 8
    prepared, data = _run(cfg, top=50.0)
    converted = convert(prepared)
    kinds = _kinds(converted)
    assert OpKind.RELU not in kinds and OpKind.RELU6 in kinds and OpKind.HARDTANH not in kinds
    for _, fq in fake_quantizers(prepared):
        fq.enable_observer(False)
    assert all(torch.equal(converted(x), prepared(x)) for x in data)


def test_drop_redundant_activations_keeps_relu_for_symmetric_int8():
    prepared, _ = _run(QuantizerConfig.presets.w8a8_sym(), top=0.5)  # zero point mid-range: Q does not clamp at 0
    kinds = _kinds(convert(prepared))
    assert OpKind.RELU in kinds and OpKind.RELU6 in kinds and OpKind.HARDTANH in kinds


def test_drop_redundant_activations_is_a_no_op_before_convert():
    prepared, _ = _run(QuantizerConfig.presets.w8a8(), top=0.5)  # quantizers not frozen yet
    before = prepared.code
    assert drop_redundant_activations(prepared).changes == 0
    assert prepared.code == before


@pytest.mark.parametrize("name", ["relu", "relu6", "hardtanh"])
def test_drop_redundant_activations_counts_removed_nodes(name):
    prepared, _ = _run(QuantizerConfig.presets.w8a8(), top=0.5)
    converted = convert(prepared)
    assert sum(k is OpKind(name) for k in _kinds(prepared)) == 1
    assert sum(k is OpKind(name) for k in _kinds(converted)) == 0
