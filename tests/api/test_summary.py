import pytest
import torch

from coreai_opt.api import calibrate, convert, prepare, summary
from coreai_opt.config import QuantizerConfig
from tests.zoo import build


def test_summary_lists_quantizers_with_specs_and_qparams():
    model, example, batches = build("conv1d_groupnorm")
    prepared = prepare(model, QuantizerConfig.presets.w8a8(), example)
    before = summary(prepared)
    assert {r.qparams for r in before.quantizers if r.role == "activation"} == {"not calibrated"}
    calibrate(prepared, batches[:2], progress=False)
    report = summary(convert(prepared))
    text = str(report)
    print(text)
    assert text.splitlines()[0] == "coreai_opt summary (capture=fx, converted=True): 13 quantizers, 2 float ops"
    assert text.splitlines()[1].split() == ["quantizer", "nodes", "consumers", "op", "kind", "role", "spec", "scale",
                                            "/", "zero", "point"]
    rows = {r.serves: r for r in report.quantizers}
    assert rows["conv1.weight"].spec == "int8 symmetric_with_clipping per_channel(axis=0) minmax/static"
    assert rows["conv1.weight"].qparams.startswith("16 scales in [")
    assert rows["conv1.bias"].role == "bias" and rows["conv1.bias"].qparams == "derived"
    # the GroupNorms run in float in onnxruntime and their readers (3-D SiLUs) too: no quantizer between them
    assert "gn1.output" not in rows and {(f.module, f.op_kind) for f in report.float_ops} == {
        ("gn1", "group_norm"), ("gn2", "group_norm")}
    act = rows["act.output"]
    assert act.spec == "uint8 asymmetric per_tensor minmax/global_minmax"
    scale, zero_point = act.qparams.split(" / ")
    assert float(scale) > 0 and 0 <= int(zero_point) <= 255
    assert rows["act[1].output"].nodes == ("act_1_output_fq",)  # the shared SiLU module's second call site


def test_summary_shows_ops_left_float_with_their_reason():
    model, example, _ = build("transformer_encoder")
    # softmax alone would still be quantized by the matmul that reads it: leave both float
    cfg = QuantizerConfig.presets.w8a8().set_op_kind("softmax", None).set_op_kind("matmul", None)
    prepared = prepare(model, cfg, example)
    report = summary(prepared)
    floats = {(f.module, f.op_kind): f.reason for f in report.float_ops}
    # the final norm feeds a mean over the sequence (float in onnxruntime, like the norm itself)
    assert floats.pop(("ln", "layer_norm")) == ("ln (ln) left float: layer_norm has no onnxruntime integer kernel "
                                                 "(its edges are quantized only where a neighbour's kernel reads them)")
    # the scores matmul feeds softmax directly (its 1/sqrt(d) is folded into the q projection): float as well
    assert floats == {
        ("blocks.0.attn", "matmul"): "blocks.0.attn (matmul) output left float: no activation spec (op_kind:matmul)",
        ("blocks.1.attn", "matmul"): "blocks.1.attn (matmul_2) output left float: no activation spec "
                                     "(op_kind:matmul)",
        ("blocks.0.attn", "softmax"): "blocks.0.attn (softmax) output left float: no activation spec (op_kind:softmax)",
        ("blocks.1.attn", "softmax"): "blocks.1.attn (softmax_1) output left float: no activation spec "
                                      "(op_kind:softmax)"}
    text = str(report)
    assert "ops left float:" in text and "no activation spec (op_kind:softmax)" in text


def test_summary_rejects_plain_modules():
    with pytest.raises(TypeError, match="coreai_opt.prepare"):
        summary(torch.nn.Linear(2, 2))
