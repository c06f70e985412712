"""No pipeline stage holds a full extra copy of the fp32 weights (issue 20), measured as process RSS.

A subprocess warms every stage up on a tiny model (imports, the exporter's and onnxruntime's one-off setup), then
runs prepare -> calibrate -> convert -> export -> verify (w8a8) on four square linears and reports each stage's peak
RSS above the RSS it had once the model was built, in multiples of the fp32 weight bytes (one full copy is 1.0).
Before issue 20 prepare and convert each kept a full copy (+1.0x each) and export peaked above +3x.

The default test uses four 3584 x 3584 linears (205 MB); the ``bigmemory`` one the issue's 12288 x 12288 model
(2.42 GB, needs about 6 GB free; ``pytest -m bigmemory tests/memory``) with the issue's absolute bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent('''
    import gc, json, pathlib, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from torch import nn
    import coreai_opt as co
    from benchmarks.memory.pipeline_memory import StageSampler, linears

    def pipeline(model, x, path, sampler, report):
        config = co.QuantizerConfig.presets.w8a8()
        prepared = sampler.run("prepare", lambda: co.prepare(model, config, (x,)), report)
        sampler.run("calibrate", lambda: co.calibrate(prepared, [x], progress=False), report)
        converted = sampler.run("convert", lambda: co.convert(prepared), report)
        del prepared
        sampler.run("export", lambda: co.export_onnx(converted, (x,), path), report)
        return sampler.run("verify", lambda: co.verify_onnx(converted, path, [x]), report)

    out, width = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    sampler = StageSampler()
    torch.manual_seed(0)
    pipeline(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).eval(), torch.randn(2, 64), out / "warm.onnx",
             sampler, {})
    model, (x,), _ = linears(width)
    weights = sum(p.numel() * 4 for p in model.parameters())
    gc.collect()
    start = sampler.process.memory_info().rss
    report = {}
    result = pipeline(model, x, out / "big.onnx", sampler, report)
    print(json.dumps({"ok": bool(result.ok), "qgemm": result.fusion.integer_compute.get("QGemm", 0),
                      "start": start / weights, "where": {s: r["where"] for s, r in report.items()},
                      "peak": {s: r["peak"] / weights for s, r in report.items()}}))
''')

#: Peak growth over the RSS with the model built, in fp32-weight multiples, on the 205 MB model (one full copy is
#: 1.0). Measured: prepare 0.004, calibrate 0.006, convert 0.008 (before issue 20: about 1.0 and 1.4 for prepare and
#: convert: a deep copy plus NaN masks).
MAX_PTQ_STAGE_GROWTH = 0.25
#: export: the int8 protobuf (0.25) and its serialisation (upb's buffer plus the Python bytes); measured 0.74
#: (before: above 3, the float protobuf plus the whole-tensor fold's float64 temporaries).
MAX_EXPORT_GROWTH = 0.9
#: verify: onnxruntime's session (int8 weights and its prepacked QGemm copies) next to the eager forward's
#: fake-quantized weight and, since verify compares codes integer-exactly, one column slice of a weight's float64
#: codes at a time. Measured 0.79 (Dec 5, with the eager run repeated on the file's codes). A full extra copy of
#: the weights would add 1.0 to the ~0.8 of the session: this bound still catches it.
MAX_VERIFY_GROWTH = 1.5

#: The child runs with glibc's mmap threshold fixed at 4 MiB, as ``coreai-opt`` sets it for its own process
#: (coreai_opt/cli/allocator.py): weight-sized buffers are unmapped when freed. Without it glibc keeps freed
#: weight-sized blocks on its heap and the RSS peaks measure that retention, not the copies the pipeline holds
#: (the same verify: 1.63 without, 0.79 with; earlier runs without moved between 0.88 and 1.56 run to run).
_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "4194304"}


def _run(tmp_path: Path, width: int) -> dict[str, object]:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), str(width)], capture_output=True,
                          text=True, check=False, cwd=root, env={**os.environ, **_ALLOCATOR})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["ok"] and result["qgemm"] == 4
    return result


def test_no_stage_holds_a_full_extra_copy_of_the_weights(tmp_path: Path) -> None:
    result = _run(tmp_path, 3584)
    growth = {stage: peak - result["start"] for stage, peak in result["peak"].items()}
    assert max(growth[s] for s in ("prepare", "calibrate", "convert")) <= MAX_PTQ_STAGE_GROWTH, result
    assert growth["export"] <= MAX_EXPORT_GROWTH, result
    assert growth["verify"] <= MAX_VERIFY_GROWTH, result


@pytest.mark.bigmemory
def test_the_2_4_gb_model_peaks_below_twice_its_weights(tmp_path: Path) -> None:
    result = _run(tmp_path, 12288)
    assert max(result["peak"].values()) <= 2.0, result
