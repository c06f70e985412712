"""Smoke test: the benchmark script runs end to end on one tiny case and writes a report (no timing thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.timeout(600)  # generous: the suite may share 2 cores; about 25 s on a quiet machine
def test_benchmark_script_runs_tiny_accuracy_case(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("onnxruntime.quantization")
    from benchmarks import run

    output = tmp_path / "RESULTS.md"
    argv = ["comparison", "--quick", "--only", "accuracy", "--tiny", "--output", str(output),
            "--work-dir", str(tmp_path / "work")]
    assert run.main(argv) == 0
    text = output.read_text()
    assert "## Where we lose" in text
    assert "## 1. Accuracy on real data" in text
    assert "| float (fp32 ONNX) |" in text
    assert "| ORT quantize_static (MinMax) |" in text
    assert "section failed" not in text
    assert "CPU:" in text and "onnxruntime" in text
    assert "- Command: `python -m benchmarks.run comparison --quick --only accuracy --tiny" in text
