import copy

import pytest
import torch

from coreai_opt.api import calibrate, convert, enable_fake_quant, enable_observers, prepare
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from tests.zoo import build


def test_convert_before_calibrate_names_uncalibrated_quantizers():
    model, example, _ = build("conv1d_groupnorm")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    with pytest.raises(ValueError, match=r"7 activation quantizer\(s\) were never calibrated: conv1.output, "
                                         r"conv2.output, .*x.input, act.output, act\[1\].output; run "
                                         r"coreai_opt.calibrate"):
        convert(prepared)


def test_convert_weight_only_needs_no_calibration():
    model, example, batches = build("resnet18")
    prepared = prepare(model, QuantizerConfig.presets.w8(), example)
    converted = convert(prepared)
    assert all(fq.export_mode for _, fq in fake_quantizers(converted))
    assert torch.equal(converted(batches[0]), prepared(batches[0]))


def test_convert_leaves_prepared_model_unchanged_and_rejects_second_convert():
    model, example, batches = build("conv_transpose_decoder")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    calibrate(prepared, batches[:2], progress=False)
    code, state = prepared.code, copy.deepcopy(prepared.state_dict())
    converted = convert(prepared)
    # convert drops every relu into the quantizer after it (its clamp does the relu's work); the quantizer modules
    # keep their tensor's name (``relu_output_fq``), so count the ops by kind, not the code text
    assert prepared.code == code
    relus = [sum(get_meta(n).kind is OpKind.RELU for n in gm.graph.nodes) for gm in (prepared, converted)]
    assert relus == [5, 0]
    # tensors, and each quantizer's spec (its ``_extra_state`` dict)
    assert all(torch.equal(v, state[k]) if isinstance(v, torch.Tensor) else v == state[k]
               for k, v in prepared.state_dict().items())
    assert not any(fq.export_mode for _, fq in fake_quantizers(prepared))
    with pytest.raises(ValueError, match="already converted"):
        convert(converted)
    with pytest.raises(ValueError, match="quantizers frozen"):
        enable_observers(converted, True)


@pytest.mark.parametrize("name", ["resnet18", "transformer_encoder", "torch_transformer"])
def test_convert_prepared_and_converted_round_trip_through_state_dict_and_deepcopy(name):
    model, example, batches = build(name)
    cfg = QuantizerConfig.presets.w8a8()
    prepared = prepare(model, cfg, example)
    calibrate(prepared, batches[:2], progress=False)
    converted = convert(prepared)
    fresh = prepare(model, cfg, example)
    fresh.load_state_dict(prepared.state_dict(), strict=True)
    x = batches[2]
    assert torch.equal(fresh(x), prepared(x))
    fresh_converted = prepare(model, cfg, example)
    fresh_converted.load_state_dict(converted.state_dict(), strict=True)
    assert torch.equal(convert(fresh_converted)(x), converted(x))
    assert torch.equal(copy.deepcopy(converted)(x), converted(x))
    assert torch.equal(copy.deepcopy(prepared)(x), prepared(x))


def test_convert_fake_quant_off_gives_float_model_and_on_matches_converted():
    model, example, batches = build("mobilenet_v2")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    calibrate(prepared, batches[:2], progress=False)
    converted = convert(prepared)
    with torch.no_grad():
        enable_fake_quant(prepared, False)
        assert torch.allclose(prepared(batches[3]), model(batches[3]), rtol=1e-4, atol=1e-5)  # BN folded
        enable_fake_quant(prepared, True)
        assert torch.equal(prepared(batches[3]), converted(batches[3]))


def test_convert_accepts_dynamic_linear_input_quantizers_without_calibration():
    model, example, batches = build("transformer_encoder")
    cfg = QuantizerConfig(weight=QuantizerConfig.presets.w8().weight, activation=dynamic_activation_spec())
    prepared = prepare(model, cfg, example)
    converted = convert(prepared)
    dynamic = [n for n in converted.graph.nodes
               if n.op == "call_module" and isinstance(converted.get_submodule(str(n.target)), DynamicFakeQuantize)]
    assert len(dynamic) == 9  # per block: ln1 (shared by q/k/v), attention output, ln2, gelu; plus the head input
    assert all(get_meta(u).kind is OpKind.LINEAR for n in dynamic for u in n.users)
    with torch.no_grad():
        ref, out = model(batches[0]), converted(batches[0])
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())
    print(f"dynamic w8 + uint8 dynamic activations: SQNR {float(sqnr):.1f} dB")
    assert float(sqnr) > 25
