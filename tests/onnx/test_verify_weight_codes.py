"""verify_onnx compares the file's stored weights with eager's, code by code (coreai_opt.onnx.verify.weight_codes)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

import coreai_opt as co
from benchmarks.verify.mutations import per_channel_scale_rolled, weight_codes_plus_3
from tests.zoo import ZOO, build

W8A8 = co.QuantizerConfig.presets.w8a8

#: Zoo entry -> (weights compared, weight quantizers not paired with a stored 8-bit weight: transformer_encoder's
#: embedding table, which the file gathers before dequantizing (``gather_quantized_rows``); one of torch_transformer's
#: MultiheadAttention out_proj weights, which the exporter stores under another name).
COMPARED = {"resnet18": (21, 0), "mobilenet_v2": (53, 0), "conv_transpose_decoder": (6, 0),
            "transformer_encoder": (13, 1), "torch_transformer": (8, 1), "shape_unpack": (3, 0),
            "conv1d_groupnorm": (3, 0)}


def _export(name: str, tmp_path: Path) -> tuple[torch.nn.Module, Path, list[torch.Tensor]]:
    model, example, batches = build(name)
    prepared = co.prepare(model, W8A8(), example)
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    return converted, co.export_onnx(converted, example, tmp_path / f"{name}.onnx"), batches


@pytest.mark.parametrize("name", list(ZOO))
def test_every_stored_8bit_weight_of_a_clean_zoo_export_has_eagers_codes(name: str, tmp_path: Path) -> None:
    converted, path, batches = _export(name, tmp_path)
    report = co.verify_onnx(converted, path, batches[:1])
    assert report.ok
    assert (len(report.weights.weights), report.weights.skipped) == COMPARED[name]
    assert all(w.differing == 0 and w.max_steps == 0.0 for w in report.weights.weights)  # bit-identical
    assert f"{COMPARED[name][0]} weight(s) compared (0 failing)" in str(report)


def test_a_few_corrupted_weight_codes_are_caught_in_the_stored_weight_itself(tmp_path: Path) -> None:
    converted, path, batches = _export("shape_unpack", tmp_path)
    bad = tmp_path / "bad.onnx"
    onnx.save(weight_codes_plus_3(onnx.load(str(path))), str(bad))  # 2 % of one weight's codes + 3, same name
    report = co.verify_onnx(converted, bad, batches[:1])
    assert not report.ok
    first = report.weights.first_failing
    # round(2 % of 256) = 5 codes moved by 3 steps, found in the middle linear's stored weight
    assert (first.module, first.initializer, first.codes, first.differing) == ("mix_weight_fq", "mix.weight_quantized",
                                                                              256, 5)
    assert first.max_steps == pytest.approx(3.0, abs=1e-4)
    assert "first failing weight mix_weight_fq (mix.weight_quantized): 5 of 256 codes differ" in str(report)


def test_a_per_channel_scale_laid_out_in_the_wrong_order_is_caught_in_the_stored_weight(tmp_path: Path) -> None:
    converted, path, batches = _export("resnet18", tmp_path)
    bad = tmp_path / "rolled.onnx"
    onnx.save(per_channel_scale_rolled(onnx.load(str(path))), str(bad))
    report = co.verify_onnx(converted, bad, batches[:1])
    failing = [w for w in report.weights.weights if not w.ok]
    assert not report.ok and len(failing) == 1  # the one weight whose scales moved, no other
    assert failing[0].differing > 0


def test_check_quantizers_off_compares_no_weights(tmp_path: Path) -> None:
    converted, path, batches = _export("shape_unpack", tmp_path)
    report = co.verify_onnx(converted, path, batches[:1], check_quantizers=False)
    assert report.weights.weights == () and report.weights.skipped == 0


class _SharedSquareLinear(torch.nn.Module):
    """One 32 x 32 linear applied three times (HRM's recurrent modules, a weight-tied loop): its stored weight, kept
    transposed for the MatMuls, has three readers in the file and its quantizer three in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.relu(self.lin(x))
        return self.out(x)


def test_a_square_weight_read_by_several_products_is_compared_in_the_orientation_they_all_use(tmp_path: Path):
    """All readers agree on the transposed layout; comparing as stored made 988 of 1024 codes differ (hf-hrm_text)."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 8, 32),) for _ in range(3)]
    prepared = co.prepare(_SharedSquareLinear().eval(), W8A8(), batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, batches[0], tmp_path / "loop.onnx")
    model = onnx.load(str(path))
    readers = [n for n in model.graph.node if any("lin.weight" in i for i in n.input)]
    (dequantize,) = [n for n in readers if n.op_type == "DequantizeLinear"]
    assert sum(dequantize.output[0] in n.input for n in model.graph.node) == 3  # three products read it
    report = co.verify_onnx(converted, path, batches)
    assert report.ok, str(report)
    shared = [w for w in report.weights.weights if w.initializer == "lin.weight_quantized"]
    assert len(shared) == 3 and all(w.codes == 1024 and w.differing == 0 for w in shared)
