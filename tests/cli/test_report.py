"""The quantize report: sizes, latency, layers left float, tuning steps, a legend, and safe writes."""

from __future__ import annotations

import json
import os
import textwrap

import onnx
import pytest

from coreai_opt.cli.main import main

TRANSFORMER = textwrap.dedent(
    """
    import torch
    from coreai_opt.reference_models import transformer_encoder


    def make():
        torch.manual_seed(0)
        return transformer_encoder(dim=32, depth=1, heads=2, vocab_size=50, num_classes=3, max_len=16).eval()
    """
)


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory):
    """One quantize run with every tuning flag and a planted symlink at the text report's path."""
    root = tmp_path_factory.mktemp("tuned")
    (root / "tf.py").write_text(TRANSFORMER)
    victim = root / "victim.txt"
    victim.write_text("precious\n")
    (root / "out").mkdir()
    os.symlink(victim, root / "out" / "tf.report.txt")
    code = main(["quantize", f"{root / 'tf.py'}:make", "--input", "tokens:int64:4,8:0-49", "-o",
                 str(root / "out" / "tf.onnx"), "--smoothquant", "--search-calibration", "--keep-float-top", "1",
                 "--latency-runs", "3"])
    assert code == 0
    return root


def test_report_json_has_sizes_latency_float_layers_and_tuning(tuned_run):
    report = json.loads((tuned_run / "out" / "tf.report.json").read_text())
    onnx_path = tuned_run / "out" / "tf.onnx"
    assert report["ok"] is True and report["opset"] == 20  # the encoder has a GELU
    assert report["sizes"]["quantized"]["file_bytes"] == onnx_path.stat().st_size
    initializers = onnx.load(str(onnx_path)).graph.initializer
    assert report["sizes"]["quantized"]["weight_bytes"] == sum(t.ByteSize() for t in initializers)
    fp32, quantized = report["sizes"]["fp32"], report["sizes"]["quantized"]
    assert quantized["weight_bytes"] < 0.5 * fp32["weight_bytes"]  # int8 weights; one linear kept float
    latency = report["latency_ms"]
    assert latency["threads"] == 1 and latency["batch"] == 1 and latency["runs"] == 3
    assert latency["fp32"] > 0 and latency["quantized"] > 0 and latency["statistic"] == "median"
    # --keep-float-top 1 keeps the most sensitive layer float; the report names it with the reason
    kept = report["tuning"]["kept float (most sensitive first)"]
    assert len(kept) == 1
    # the kept linear, the mean over the tokens and the final norm that feeds it, which onnxruntime runs in float
    # whatever surrounds them
    layers = {(f["module"], f["op_kind"]): f["reason"] for f in report["float_layers"]}
    assert set(layers) == {(kept[0], "linear"), ("", "avg_pool"), ("ln", "layer_norm")}
    assert "layer_norm has no onnxruntime integer kernel" in layers[("ln", "layer_norm")]
    assert "weight left float: no weight spec" in layers[(kept[0], "linear")]
    assert "mean over other axes than the spatial ones" in layers[("", "avg_pool")]
    float_weights = {t.name for t in initializers if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2}
    assert f"{kept[0]}.weight" in float_weights
    assert report["tuning"]["smoothquant"].startswith("alpha 0.5, ")
    assert sum(report["tuning"]["range calculators chosen"].values()) >= 5


def test_report_text_explains_every_column(tuned_run):
    text = (tuned_run / "out" / "tf.report.txt").read_text()
    for term in ("max |diff|", "steps", "argmax agree", "ok", "integer conv/matmul", "float conv/matmul",
                 "other integer ops", "Q/DQ left"):
        assert f"\n    {term} " in text, term
    assert "max |diff| in quantization steps of that output" in text
    assert "(onnxruntime CPU, 1 thread(s), batch 1, median of 3 runs)" in text
    assert "layers left float (3):" in text


def test_report_replaces_a_planted_symlink_instead_of_writing_through_it(tuned_run):
    assert (tuned_run / "victim.txt").read_text() == "precious\n"
    report = tuned_run / "out" / "tf.report.txt"
    assert not report.is_symlink() and report.read_text().startswith("model: ")
