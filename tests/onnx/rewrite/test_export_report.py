"""export_onnx stores the rewrite report in the file; fusion_report and coreai-opt inspect show it."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import coreai_opt
from coreai_opt.cli.main import main
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, fusion_report
from coreai_opt.onnx.rewrite import POST_PASSES, read_report
from coreai_opt.onnx.rewrite.rewrite_report import METADATA_KEY


class _TokenMlp(nn.Module):
    """fc1 -> GELU -> fc2 on ``[batch, seq, 32]``: three linears on a rank-3 input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("report")
    paths = {}
    for preset in ("w8a8", "w4a8"):
        torch.manual_seed(0)
        example = torch.randn(2, 6, 32)
        prepared = coreai_opt.prepare(_TokenMlp().eval(), QuantizerConfig.presets.get(preset)(), (example,))
        coreai_opt.calibrate(prepared, [(torch.randn(4, 6, 32),) for _ in range(2)], progress=False)
        paths[preset] = export_onnx(coreai_opt.convert(prepared), (example,), directory / f"{preset}.onnx")
    return paths


def test_exported_file_records_every_rule_count_in_order(exported: dict[str, Path]) -> None:
    report = read_report(onnx.load(str(exported["w8a8"])))
    assert list(report.counts) == [rule.name for rule in POST_PASSES]
    assert report.counts["fold_quantized_weights"] == 2  # the two weights (the linears on 3-D inputs keep float biases)
    assert report.counts["linears_to_gemm"] == 2 and report.counts["collapse_reshapes"] == 2
    assert report.counts["dynamic_matmuls_to_integer"] == 0 and report.counts["gather_quantized_rows"] == 0
    assert not report.skipped


def test_exported_file_names_the_linears_left_as_matmul_and_why(exported: dict[str, Path]) -> None:
    report = read_report(onnx.load(str(exported["w4a8"])))
    assert report.counts["linears_to_gemm"] == 0 and report.counts["collapse_reshapes"] == 0
    misses = [str(s) for s in report.skipped if s.rule == "linears_to_gemm"]
    assert len(misses) == 2
    assert misses[0].startswith("linears_to_gemm skipped node_MatMul") and misses[0].endswith(
        " (fc1/linear): weight is per-block")
    assert misses[1].endswith(" (fc2/linear_1): weight is per-block")


def test_exported_report_is_deterministic_and_outside_the_graph(exported: dict[str, Path], tmp_path: Path) -> None:
    model = onnx.load(str(exported["w4a8"]))
    (entry,) = [e for e in model.metadata_props if e.key == METADATA_KEY]
    assert entry.value.startswith('{"rules":[["fold_quantized_weights",')


def test_fusion_report_ends_with_the_rewrite_report(exported: dict[str, Path]) -> None:
    report = fusion_report(exported["w4a8"])
    assert report.rewrites == read_report(onnx.load(str(exported["w4a8"])))
    text = str(report)
    assert text.splitlines()[0] == "onnxruntime fusion report"
    assert text.endswith(str(report.rewrites)) and "(fc1/linear): weight is per-block" in text


def test_inspect_shows_the_rewrite_report_with_and_without_fusion(exported: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--no-fusion"]):
        assert main(["inspect", str(exported["w4a8"]), *extra]) == 0
        out = capsys.readouterr().out
        assert out.count("ONNX rewrites applied by export_onnx") == 1
        assert "(fc2/linear_1): weight is per-block" in out


def test_inspect_names_a_damaged_rewrite_report(exported: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = onnx.load(str(exported["w8a8"]))
    next(e for e in model.metadata_props if e.key == METADATA_KEY).value = "not json"
    onnx.save(model, str(tmp_path / "damaged.onnx"))
    assert main(["inspect", str(tmp_path / "damaged.onnx"), "--no-fusion"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "coreai_opt.rewrites metadata entry is not a rewrite report" in err
