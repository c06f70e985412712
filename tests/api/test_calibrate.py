import pytest
import torch
from torch import nn

from coreai_opt.api import calibrate, prepare
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config import QuantizerConfig
from tests.zoo import build


class _KwargModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def _input_fq(prepared):
    return dict(fake_quantizers(prepared))["x_input_fq"]


def test_calibrate_resets_statistics_so_example_input_does_not_bias_them():
    model = _KwargModel().eval()
    huge = (torch.full((2, 4), 1000.0), torch.zeros(2, 4))
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), huge, qat=True)
    prepared(*huge)  # QAT forward observes the huge example
    assert float(_input_fq(prepared).calculator.scale) > 3.0
    batches = [(torch.rand(8, 4), torch.rand(8, 4)) for _ in range(3)]
    calibrate(prepared, batches, progress=False)
    top = max(float(b[0].max()) for b in batches)
    scale = float(_input_fq(prepared).calculator.scale)
    print(f"input scale after calibration {scale:.5f} (max observed {top:.4f})")
    assert scale == pytest.approx(top / 255, rel=1e-5)


def test_calibrate_restores_mode_and_flags_and_accepts_dicts():
    prepared = prepare(_KwargModel(), QuantizerConfig.presets.w8a8(), (torch.randn(2, 4), torch.randn(2, 4)),
                       qat=True)
    fq = _input_fq(prepared)
    fq.enable_observer(False)
    calibrate(prepared, [{"x": torch.randn(8, 4), "y": torch.randn(8, 4)}], progress=False)
    assert prepared.training
    assert (bool(fq.observer_enabled), bool(fq.fake_quant_enabled)) == (False, True)
    assert fq.calculator.has_qparams
    assert torch.is_grad_enabled()


def test_calibrate_stops_after_max_batches():
    prepared = prepare(_KwargModel(), QuantizerConfig.presets.w8a8(), (torch.randn(2, 4), torch.randn(2, 4)))
    batches = [(torch.rand(8, 4), torch.rand(8, 4)), (torch.rand(8, 4) * 100, torch.rand(8, 4))]
    calibrate(prepared, batches, max_batches=1, progress=False)
    assert float(_input_fq(prepared).calculator.scale) == pytest.approx(float(batches[0][0].max()) / 255, rel=1e-5)


def test_calibrate_rejects_empty_data():
    prepared = prepare(_KwargModel(), QuantizerConfig.presets.w8a8(), (torch.randn(2, 4), torch.randn(2, 4)))
    with pytest.raises(ValueError, match="calibration data is empty"):
        calibrate(prepared, [], progress=False)


def test_calibrate_names_input_with_wrong_dtype():
    model, example, _ = build("transformer_encoder")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    with pytest.raises(ValueError, match=r"input 'tokens' is float32 of shape \(2, 12\).*int64"):
        calibrate(prepared, [torch.randn(2, 12)], progress=False)


def test_calibrate_names_input_with_wrong_shape():
    model, example, _ = build("conv1d_groupnorm")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(2, 3, 32\), the example input had \(2, 4, 32\)"):
        calibrate(prepared, [torch.randn(2, 3, 32)], progress=False)
    model, example, _ = build("shape_unpack")  # exported graph: only the batch dimension is dynamic
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(4, 9, 16\).*only the batch dimension may change"):
        calibrate(prepared, [torch.randn(4, 9, 16)], progress=False)


def test_calibrate_sync_modes_without_distributed_are_accepted_and_validated():
    prepared = prepare(_KwargModel(), QuantizerConfig.presets.w8a8(), (torch.randn(2, 4), torch.randn(2, 4)))
    batches = [(torch.rand(8, 4), torch.rand(8, 4))]
    scales = []
    for sync in ("auto", "every_batch", "never"):
        calibrate(prepared, batches, progress=False, sync=sync)
        scales.append(float(_input_fq(prepared).calculator.scale))
    assert scales[0] == scales[1] == scales[2]
    with pytest.raises(ValueError, match="sync='always' is not one of"):
        calibrate(prepared, batches, sync="always")


def test_calibrate_rejects_models_not_from_prepare():
    with pytest.raises(TypeError, match=r"coreai_opt.prepare"):
        calibrate(nn.Linear(2, 2), [torch.randn(1, 2)])


def test_calibrate_never_rescans_weights_per_batch_and_recommits_only_changed_ones():
    from coreai_opt.api.internals.quantizer_state import weight_quantizer_inputs

    model, example, batches = build("resnet18")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    pairs = weight_quantizer_inputs(prepared)
    weight_fqs = [fq for fq, _ in pairs]
    calls = {id(fq.calculator): 0 for fq in weight_fqs}
    for fq in weight_fqs:
        original = fq.calculator.observe

        def counting(x, _calc=fq.calculator, _orig=original):
            calls[id(_calc)] += 1
            return _orig(x)

        fq.calculator.observe = counting
    before = [fq.calculator.scale.clone() for fq in weight_fqs]
    calibrate(prepared, batches, progress=False)
    # weights are unchanged since prepare committed them: no weight is scanned, not even once
    assert len(weight_fqs) == 21 and set(calls.values()) == {0}
    assert all(torch.equal(b, fq.calculator.scale) for b, fq in zip(before, weight_fqs, strict=True))
    changed_fq, changed_weight = pairs[3]
    with torch.no_grad():
        changed_weight.mul_(2.0)  # an in-place edit (optimizer step, load_state_dict) bumps the tensor's version
    calibrate(prepared, batches, progress=False)
    assert calls[id(changed_fq.calculator)] == 1 and sum(calls.values()) == 1
    torch.testing.assert_close(changed_fq.calculator.scale, before[3] * 2.0, rtol=1e-6, atol=0)
    # a replaced parameter is a new tensor (even if Python reuses the old one's id): committed again
    replaced_fq = pairs[4][0]
    source = next(n.args[0] for n in prepared.graph.nodes if n.op == "call_module"
                  and prepared.get_submodule(str(n.target)) is replaced_fq)
    owner, _, attr = str(source.target).rpartition(".")
    setattr(prepared.get_submodule(owner), attr, torch.nn.Parameter(pairs[4][1].detach() * 3.0))
    calibrate(prepared, batches, progress=False)
    assert calls[id(replaced_fq.calculator)] == 1 and sum(calls.values()) == 2
    torch.testing.assert_close(replaced_fq.calculator.scale, before[4] * 3.0, rtol=1e-6, atol=0)
