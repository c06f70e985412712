"""``co.auto_quantize`` on the real all-MiniLM-L6-v2 with defaults, checked in onnxruntime (slow)."""

from __future__ import annotations

import time
import warnings

import pytest

import coreai_opt as co
from benchmarks.minilm import harness as H
from benchmarks.minilm import ours as minilm_ours

pytestmark = pytest.mark.slow

NNCF_MEAN_COS = 0.9972  # NNCF transformer mode on the same sentences (benchmarks/minilm/RESULTS.md)


def test_auto_quantize_minilm_defaults_beat_every_peer_within_dynamic_latency_and_ten_pipelines(
        setup, tmp_path) -> None:
    model, cal, ev, reference = setup
    example, batches = (cal.input_ids[:2], cal.attention_mask[:2]), cal.batches(16)

    start = time.perf_counter()
    plain = minilm_ours.prepare_calibrate(model, co.QuantizerConfig.presets.w8a8(), example, batches)
    minilm_ours.export(plain, example, tmp_path / "plain.onnx")
    plain_s = time.perf_counter() - start

    start = time.perf_counter()
    result = co.auto_quantize(model, batches, example, progress=False)
    auto_s = time.perf_counter() - start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = co.export_onnx(result.converted, example, tmp_path / "auto.onnx", output_names=["sentence_embedding"])
    metrics = H.compare(reference, H.ort_embed(path, ev))
    report = result.report
    print(report.table())
    print(f"ORT on 200 held-out sentences: {metrics}; auto_quantize {auto_s:.0f} s = {auto_s / plain_s:.1f}x the "
          f"plain w8a8 prepare/calibrate/export ({plain_s:.0f} s)")
    # the default bound: never estimated slower than every linear dynamic (quantize_dynamic)
    assert report.latency_bound_us == pytest.approx(report.reference_latency_us["dynamic"], rel=1e-9)
    assert report.latency_us <= report.latency_bound_us
    assert metrics.mean_cosine >= 0.997 and metrics.mean_cosine > NNCF_MEAN_COS
    assert metrics.topk_agreement >= 0.95
    assert auto_s <= 10 * plain_s
