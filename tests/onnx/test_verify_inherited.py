"""verify_onnx on differences a quantizer inherits from the quantizers it reads (issue 28 rules 3 and 4, issue 30).

The pattern of timm swin_s3 / davit (window attention): a float kernel's codes flip at rounding ties, a crop of a
zero-padded tensor copies them exactly, and later integer kernels read the copy. The copy's flips are the float
kernel's, with its one-way shift (float kernels are exempt from the bias rule), so the rule may judge only a
quantizer's own differences; and the crop keeps fewer codes than it read, so the fraction of differing codes grows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coreai_opt
from benchmarks.verify.mutations import judge_defect
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.verify.code_rules import BIAS_Z


class _PaddedCrop(nn.Module):
    """Conv over a zero-padded map (float Conv in onnxruntime behind blocked int4 weights), cropped back, rolled and
    added to a pooled input (QLinearConcat / QLinearAdd reading the crop's codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(F.pad(x, (0, 16, 0, 16)))[:, :, :16, :16]
        return self.head(torch.roll(y, 1, 2) + x.mean(1, keepdim=True))


@pytest.fixture(scope="module")
def crop(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    batches = [(torch.randn(16, 16, 16, 16),) for _ in range(3)]
    prepared = coreai_opt.prepare(_PaddedCrop().eval(), coreai_opt.QuantizerConfig.presets.w4a8(), batches[0])
    coreai_opt.calibrate(prepared, batches[:2], progress=False)
    model = coreai_opt.convert(prepared)
    return model, export_onnx(model, batches[0], tmp_path_factory.mktemp("crop") / "crop.onnx"), batches[2:]


def test_exact_copy_of_a_float_kernels_shifted_flips_is_not_flagged(crop) -> None:  # noqa: ANN001
    """Clean file: the crop's codes are an exact copy of the float conv's (642 of 131072 differ, one-way: z > 6
    against sqrt(Σd²), the old rule's verdict), and the integer kernels after it inherit them: ok."""
    model, path, batches = crop
    report = verify_onnx(model, path, batches)
    assert report.ok, str(report)
    by_module = {q.module: q for q in report.quantizers}
    conv, copy = by_module["conv"], by_module["conv_output_fq"]
    assert conv.kernels == "float" and copy.kernels == "exact"
    differing = round(copy.count * (1 - copy.identical))
    assert 100 < differing <= round(conv.count * (1 - conv.identical))  # the copy's flips are the conv's
    total = copy.mean_signed * copy.count
    assert abs(total) > BIAS_Z * np.sqrt(differing) + 1.0  # one-way: what the bias rule used to flag
    assert copy.rule == "exact kernels" and by_module["roll_output_fq"].ok and by_module["add_output_fq"].ok


def test_read_on_the_files_codes_the_inherited_flips_vanish_and_only_the_float_conv_keeps_its_own(crop) -> None:  # noqa: ANN001
    """Rules 3 and 4 judge each quantizer with eager reading onnxruntime's codes at the quantizers before it
    (ForceQuantizeCalls): the crop, roll, add and head inherit the conv's flips free-running, and add none."""
    model, path, batches = crop
    by_module = {q.module: q for q in verify_onnx(model, path, batches).quantizers}
    conv = by_module["conv"]
    # the float conv reads the input quantizer's identical codes: forced, it differs as much as free-running, less
    # the flips at near ties (within NEAR_TIE of a boundary: the kernel's rounding, kept as onnxruntime's)
    assert conv.identical <= conv.own_identical < 1.0
    downstream = [by_module[m] for m in ("conv_output_fq", "roll_output_fq", "add_output_fq", "head")]
    assert any(q.identical < 1.0 for q in downstream)
    assert all(q.own_identical == 1.0 and q.ok for q in downstream), downstream


@pytest.mark.parametrize("defect", ["scale_x1.05", "scale_x1.20", "zero_point_+1", "zero_point_-1", "drop_qdq",
                                    "swap_inputs"])
def test_defects_behind_the_inherited_flips_are_still_flagged(crop, defect: str, tmp_path: Path) -> None:  # noqa: ANN001
    """Each single defect written into the clean file that moves onnxruntime's output is flagged, first quantizer
    named, by the rules that still judge inherited differences (qparams, steps, mismatch, missing). (The int8
    weight and int32 bias defects have no site in a w4a8 file.)"""
    model, path, batches = crop
    outcome = judge_defect(model, path, batches, defect, tmp_path)
    assert outcome.status in ("flagged", "output unchanged"), outcome  # not "missed", "no site" or "does not run"
    if outcome.status == "flagged":
        assert outcome.first_quantizer is not None
        assert outcome.first_rule in ("qparams", "steps", "mismatch", "missing"), outcome


class _BiasedAttention(nn.Module):
    """Attention with an additive bias (as samvit's relative positions): masked float Softmax, then attn @ v."""

    def __init__(self, tokens: int = 49, dim: int = 32) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(tokens, tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).transpose(1, 2).flatten(2))


def test_attention_average_step_gain_is_derived_from_the_files_scales(tmp_path: Path) -> None:
    """One flipped probability code moves ``attn @ v`` by ``s_p · max|v| / s_y`` of its steps (> 1: an average of
    values is finer than the values); rule 2 allows a quantizer behind it that many times the measured input steps.
    Clean file ok; a 5 % scale defect is still flagged."""
    from coreai_opt.onnx.rewrite.graph import OnnxGraph
    from coreai_opt.onnx.verify.fusion_report import optimized_model
    from coreai_opt.onnx.verify.tolerance import product_step_gain

    torch.manual_seed(0)
    batches = [(torch.randn(8, 49, 32),) for _ in range(3)]
    prepared = coreai_opt.prepare(_BiasedAttention().eval(), coreai_opt.QuantizerConfig.presets.w8a8(), batches[0])
    coreai_opt.calibrate(prepared, batches[:2], progress=False)
    model = coreai_opt.convert(prepared)
    path = export_onnx(model, batches[0], tmp_path / "attention.onnx")
    graph = OnnxGraph(optimized_model(path, "all"))
    products = [n for n in graph.nodes if n.op_type == "QLinearMatMul"]
    assert len(products) == 2  # q @ k^T and attn @ v
    attn_v = products[1]
    s_p, s_v, z_v, s_y = (float(graph.constant(attn_v.input[i])) for i in (1, 4, 5, 6))
    expected = max(s_p * s_v * max(abs(255 - z_v), z_v) / s_y, s_v * s_p * 255 / s_y)
    assert product_step_gain(attn_v, graph) == pytest.approx(expected, rel=1e-6)
    assert expected > 2  # the averaged output is finer than one probability step times a value
    report = verify_onnx(model, path, batches[2:])
    assert report.ok, str(report)
    outcome = judge_defect(model, path, batches[2:], "scale_x1.05", tmp_path)
    assert outcome.status == "flagged" and outcome.first_quantizer is not None, outcome


def test_an_output_moved_by_an_upstream_defect_is_charged_to_the_defects_quantizer(tmp_path: Path) -> None:
    """zoo shape_unpack w8a8 with its first weight negated: the output moves 27 steps (5 allowed) free-running, but
    on the file's codes at every quantizer it is exact, so the output passes and the report fails at the weight
    (255 of its 256 stored codes differ from eager's) and at the first quantizer after it (the GELU's output: proj's
    QGemm writes float into the GELU), not at an output the difference only flowed into."""
    import onnx
    from onnx import numpy_helper

    from tests.zoo import ZOO, build, preset_config

    model, example, batches = build("shape_unpack")
    prepared = coreai_opt.prepare(model, preset_config("w8a8", model), example)
    coreai_opt.calibrate(prepared, batches, progress=False)
    converted = coreai_opt.convert(prepared)
    file = onnx.load(str(export_onnx(converted, example, tmp_path / "clean.onnx")))
    weight = next(t for t in file.graph.initializer if t.name == "proj.weight_quantized")
    weight.CopyFrom(numpy_helper.from_array(np.clip(-numpy_helper.to_array(weight).astype(np.int32), -127, 127)
                                            .astype(np.int8), weight.name))
    onnx.save(file, str(tmp_path / "negated.onnx"))
    torch.manual_seed(123)
    evaluation = [(ZOO["shape_unpack"].make_input(16),) for _ in range(4)]
    report = verify_onnx(converted, tmp_path / "negated.onnx", evaluation)
    (output,) = report.outputs
    assert output.max_diff_steps is not None and output.tolerance_steps is not None
    assert output.max_diff_steps > output.tolerance_steps  # free-running: far outside
    assert output.on_file_codes is not None and output.on_file_codes.max_abs_diff == 0.0 and output.ok
    first = report.first_failing_quantizer
    assert not report.ok and first is not None and first.module == "" and first.rule == "steps"
    assert first.own_identical < 0.01  # the GELU output's codes, on the file's own inputs: 0.8 % identical
    assert [(w.module, w.differing) for w in report.weights.weights if w.differing] == [("proj_weight_fq", 255)]
