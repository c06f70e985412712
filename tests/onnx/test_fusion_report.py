from __future__ import annotations

from pathlib import Path

import pytest

from coreai_opt.onnx import FusionReport, fusion_report
from coreai_opt.onnx.rewrite import apply
from coreai_opt.onnx.rewrite.rules.fold_quantized_weights import FoldQuantizedWeights
from tests.onnx.onnx_graphs import conv_qdq_model, save


def test_fusion_report_counts_qlinearconv_for_full_qdq_conv(tmp_path: Path) -> None:
    model = conv_qdq_model()
    apply(model, [FoldQuantizedWeights()])
    report = fusion_report(save(model, tmp_path / "conv.onnx"))
    assert isinstance(report, FusionReport)
    assert report.integer_compute == {"QLinearConv": 1}
    assert report.num_float_compute == 0 and report.float_compute_nodes == ()
    assert report.all_compute_integer
    assert (report.quantize_linear, report.dequantize_linear) == (1, 1)  # graph input Q, graph output DQ


def test_fusion_report_lists_float_conv_by_name_when_output_is_not_quantized(tmp_path: Path) -> None:
    report = fusion_report(save(conv_qdq_model(with_output_q=False), tmp_path / "conv.onnx"))
    assert report.num_integer_compute == 0
    assert report.num_float_compute == 1
    assert report.float_compute_nodes == ("conv1",)
    assert not report.all_compute_integer
    assert report.dequantize_linear == 3  # input, weight, bias stay as float round trips


def test_fusion_report_str_is_a_table(tmp_path: Path) -> None:
    text = str(fusion_report(save(conv_qdq_model(with_output_q=False), tmp_path / "conv.onnx")))
    lines = text.splitlines()
    assert lines[0] == "onnxruntime fusion report"
    assert any(line.split()[:4] == ["float", "conv/matmul", "1", "Conv"] for line in lines)
    assert lines[-1].strip() == "float conv/matmul nodes: conv1"


def test_fusion_report_raises_for_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        fusion_report(tmp_path / "missing.onnx")
