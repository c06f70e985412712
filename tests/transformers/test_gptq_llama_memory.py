"""GPTQ on a ~100 M-parameter random-init Llama decoder: bounded memory and deterministic integers (slow).

Each run is a fresh process (``gptq_llama_worker.py``) so that its peak RSS is its own. Budget for the peak above
the RSS after building the float model: the prepared copy of the weights (fp32), one ``d × d`` float32 Hessian per
linear, the int8 integer weights, and the activations of a float forward (a generous 1 GiB on this 2 × 64-token
batch), i.e. nothing proportional to the number of calibration tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("gptq_llama_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _run() -> dict[str, float | str]:
    # tests/subprocess_site/sitecustomize.py declares torchvision's op schemas before transformers imports it
    # (the environment's torchvision cannot load its C++ ops beside the CPU torch; see there)
    site = os.pathsep.join([str(REPO / "tests" / "subprocess_site"), str(REPO)])
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=1800, check=False,
                          env={**os.environ, "PYTHONPATH": site})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gptq_on_a_100m_llama_stays_within_weights_plus_hessians_and_is_deterministic() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the Llama GPTQ test needs the bench extra (transformers): {exc}")
    first, second = _run(), _run()
    assert 90e6 < first["params"] < 110e6
    assert first["awaiting"] == 0  # every linear was rounded from its Hessian
    budget = first["fp32_weight_bytes"] * 1.25 + first["hessian_bytes"] + 2**30
    assert first["peak_rss"] - first["rss_after_model"] < budget
    assert first["digest"] == second["digest"]
