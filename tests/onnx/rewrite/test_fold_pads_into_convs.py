"""fold_pads_into_convs: TF-style "same" padding (an explicit zero ``F.pad`` before a ``padding=0`` conv) exports as
the convolutions' own ``pads``, so onnxruntime runs one ``QLinearConv`` per layer and no float ``Pad`` or
requantization, with eager and onnxruntime equal."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coreai_opt as co
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.onnx.rewrite.rules.fold_pads_into_convs import FoldPadsIntoConvs
from tests.onnx.rewrite.rule_checks import assert_idempotent


class _SamePadded(nn.Module):
    """Two TF-style stride-2 "same" convolutions: pad (0, 1, 0, 1) on the input, then on a relu6 activation."""

    def __init__(self, value: float = 0.0, mode: str = "constant") -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, stride=2), nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.value, self.mode = value, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = {"value": self.value} if self.mode == "constant" else {}
        y = F.relu6(self.a(F.pad(x, (0, 1, 0, 1), mode=self.mode, **pad)))
        return self.b(F.pad(y, (1, 0, 0, 1), mode=self.mode, **pad))


def _export(model: nn.Module, tmp_path: Path, capture: str = "auto") -> tuple[nn.Module, Path, list]:
    torch.manual_seed(1)
    batches = [(torch.randn(2, 3, 15, 15),) for _ in range(3)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), batches[0], capture=capture)
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    return converted, co.export_onnx(converted, batches[0], tmp_path / "m.onnx"), batches


def _optimized_ops(path: Path, tmp_path: Path) -> Counter[str]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


def test_a_zero_spatial_pad_shares_its_inputs_quantizer():
    """A zero pad is a mover; a reflect pad or a pad of 1 computes values and is not."""
    example = (torch.randn(2, 3, 15, 15),)
    kinds = {}
    models = {"zero": _SamePadded(), "one": _SamePadded(value=1.0), "reflect": _SamePadded(mode="reflect")}
    for label, model in models.items():
        prepared = co.prepare(model.eval(), co.QuantizerConfig.presets.w8a8(), example)
        pads = [n for n in prepared.graph.nodes if n.target in (F.pad, torch.ops.aten.pad.default,
                                                                 torch.ops.aten.constant_pad_nd.default)]
        kinds[label] = [get_meta(n).kind for n in pads]
    assert kinds == {"zero": [OpKind.MOVE] * 2, "one": [OpKind.OTHER] * 2, "reflect": [OpKind.OTHER] * 2}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_same_padding_exports_into_the_convolutions_and_onnxruntime_runs_no_pad(tmp_path, capture):
    converted, path, batches = _export(_SamePadded().eval(), tmp_path, capture)
    model = onnx.load(str(path))
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert not [n for n in model.graph.node if n.op_type == "Pad"]
    pads = [next(list(a.ints) for a in c.attribute if a.name == "pads") for c in convs]
    # [top, left, bottom, right]: F.pad's (left, right, top, bottom) plus the second conv's own padding=1
    assert pads == [[0, 0, 1, 1], [1, 2, 2, 1]]
    optimized = _optimized_ops(path, tmp_path)
    assert optimized["QLinearConv"] == 2 and optimized["Pad"] == 0, dict(optimized)
    assert optimized["QuantizeLinear"] == 1 and optimized["DequantizeLinear"] == 1, dict(optimized)
    report = co.verify_onnx(converted, path, [b for b, in batches])
    assert report.ok and report.outputs[0].max_diff_steps <= 1.0, str(report)
    assert_idempotent(model, FoldPadsIntoConvs())


@pytest.mark.parametrize(("value", "mode"), [(1.0, "constant"), (0.0, "reflect")])
def test_a_pad_that_computes_values_stays_and_the_file_still_verifies(tmp_path, value, mode):
    converted, path, batches = _export(_SamePadded(value, mode).eval(), tmp_path)
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("Pad") == 2
    assert co.verify_onnx(converted, path, [b for b, in batches]).ok


class _ZeroPadModules(nn.Module):
    """HF EfficientNet's stride-2 depthwise block: ``nn.ZeroPad2d`` (a module) -> depthwise conv, ``padding=0``."""

    def __init__(self) -> None:
        super().__init__()
        self.expand, self.pad = nn.Conv2d(3, 8, 1), nn.ZeroPad2d((0, 1, 0, 1))
        self.depthwise = nn.Conv2d(8, 8, 3, stride=2, groups=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depthwise(self.pad(F.relu6(self.expand(x))))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_folded_pad_pair_stays_accounted_for_so_verify_does_not_call_it_missing(tmp_path, capture):
    # before: verify_onnx failed rule `missing` on HF EfficientNet: the pad's pair, folded into the QLinearConv's
    # zero-point padding, had no node of the file traced to it
    from coreai_opt.onnx.rewrite.rewrite_report import ABSORBED_KEY

    converted, path, batches = _export(_ZeroPadModules().eval(), tmp_path, capture)
    model = onnx.load(str(path))
    assert not [n for n in model.graph.node if n.op_type == "Pad"]
    conv = next(n for n in model.graph.node if n.op_type == "Conv"
                and any(e.key == "namespace" and "depthwise:" in e.value for e in n.metadata_props))
    absorbed = [e.value for e in conv.metadata_props if e.key == ABSORBED_KEY]
    assert len(absorbed) == 1 and "quantize_dequantize" in absorbed[0]
    assert [e.key for e in conv.metadata_props if e.key == "namespace"] == ["namespace"]  # its own trace kept
    report = co.verify_onnx(converted, path, [b for b, in batches])
    assert report.ok, str(report)
    assert all(q.rule != "missing" for q in report.quantizers)
