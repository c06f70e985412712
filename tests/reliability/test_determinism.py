"""Determinism: the same model, config and data give bit-identical qparams, converted outputs and ONNX bytes across
runs, across ``torch.set_num_threads(1)`` vs ``2`` and across processes with different hash seeds.

The session's pipeline runs in this process with one thread; the check re-runs it in a fresh interpreter with two
threads and another ``PYTHONHASHSEED`` (a second export in the *same* process is compared byte for byte in
``test_saved_state.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import torch

from .conftest import Pipeline

_CHILD = """
import sys, torch
from pathlib import Path
from tests.reliability.conftest import run_pipeline
torch.set_num_threads(2)  # after the conftest import, which pins 1 thread
run = run_pipeline(onnx_path=Path(sys.argv[1]))
torch.save({"prepared": run.prepared.state_dict(), "converted": run.converted.state_dict(),
            "outputs": [run.converted(batch) for batch in run.data], "threads": torch.get_num_threads()}, sys.argv[2])
"""


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    different = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not different, f"state differs in {different}"


def _describe_difference(a: Path, b: Path) -> str:
    """Say where two ONNX files differ (for a failure message)."""
    ma, mb = onnx.load(str(a)), onnx.load(str(b))
    lines = [f"sizes {a.stat().st_size} vs {b.stat().st_size}"]
    if [n.op_type for n in ma.graph.node] != [n.op_type for n in mb.graph.node]:
        lines.append(f"nodes {[n.op_type for n in ma.graph.node]} vs {[n.op_type for n in mb.graph.node]}")
    for x, y in zip(ma.graph.node, mb.graph.node, strict=False):
        if x != y:
            lines.append(f"first differing node:\n{x}\nvs\n{y}")
            break
    names_a, names_b = [i.name for i in ma.graph.initializer], [i.name for i in mb.graph.initializer]
    if names_a != names_b:
        lines.append(f"initializers {names_a} vs {names_b}")
    lines += [f"initializer {x.name} differs" for x, y in zip(ma.graph.initializer, mb.graph.initializer,
                                                               strict=False) if x != y]
    return "\n".join(lines)


def test_run_in_another_process_with_two_threads_and_another_hash_seed_is_bit_identical(
    cnn_pipeline: Pipeline, tmp_path: Path
) -> None:
    assert torch.get_num_threads() == 1
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    onnx_path, result_path = tmp_path / "child.onnx", tmp_path / "child.pt"
    subprocess.run([sys.executable, "-c", _CHILD, str(onnx_path), str(result_path)], check=True, env=env, cwd=root,
                   timeout=600, capture_output=True)
    child = torch.load(result_path, weights_only=True)
    assert child["threads"] == 2
    _assert_same_state(cnn_pipeline.prepared.state_dict(), child["prepared"])
    _assert_same_state(cnn_pipeline.converted.state_dict(), child["converted"])
    for batch, output in zip(cnn_pipeline.data, child["outputs"], strict=True):
        assert torch.equal(cnn_pipeline.converted(batch), output)
    assert onnx_path.read_bytes() == cnn_pipeline.onnx_path.read_bytes(), _describe_difference(
        onnx_path, cnn_pipeline.onnx_path)
