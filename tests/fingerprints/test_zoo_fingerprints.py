"""Refactors change no export: every zoo model x preset builds the recorded quantizers and writes the recorded file.

``zoo_fingerprints.json`` was re-recorded with main at ad5fa22, after exports changed on purpose: the presets'
narrowed int8 weight grid ``[-127, 127]``, the ``value_info`` of folded-away values dropped, and two new rules
(``gather_block_quantized_rows``, ``clip_16bit_activations``). The record before it (774af03) proved issue 16's
file split byte-identical on all 68 cases; the earlier ones (b977fa6, 5409370) the per-edge ownership refactor. A case
compares the sha256 of the whole exported file, so the model-level metadata (the rewrite report) and every node's
``namespace`` are pinned as well as the graph. Each case prepares, calibrates, converts and exports (6-12 s each
at a load of 2-4 on the shared 2-core machine, up to 90 s at a load of 8), so the whole matrix of 68 cases runs
with ``-m slow`` and the four :data:`DEFAULT_CASES` by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coreai_opt.config import QuantizerConfig
from tests.fingerprints.zoo_fingerprints import CASES, JSON_PATH, fingerprint, spec_key
from tests.zoo import PRESETS, ZOO

RECORDED = json.loads(JSON_PATH.read_text())

#: One case per route through the exporter, run by default: fx capture with folded BatchNorm and static int8
#: convs (resnet18 w8a8), torch.export capture with per-block int4 weights written as MatMulNBits
#: (torch_transformer w4), dynamic activations after SmoothQuant's inserted Mul (transformer_encoder), float8
#: (on the smallest zoo model, a Conv1d / GroupNorm stack).
DEFAULT_CASES = (("resnet18", "w8a8", "none"), ("torch_transformer", "w4", "none"),
                 ("transformer_encoder", "w8a8_dynamic", "insert_mul"), ("conv1d_groupnorm", "fp8", "none"))


def test_every_zoo_model_and_preset_is_recorded_with_its_file_sha256() -> None:
    assert set(QuantizerConfig.presets.names()) <= set(PRESETS)
    pairs = {(name, preset) for name, preset, _ in CASES}
    assert pairs == {(name, preset) for name in ZOO for preset in (*PRESETS, "w8a8_dynamic")} and len(pairs) == 56
    assert sorted(RECORDED["cases"]) == sorted(f"{n}/{p}/{s}" for n, p, s in CASES) and len(CASES) == 68
    assert set(DEFAULT_CASES) <= set(CASES)
    exported = [key for key, entry in RECORDED["cases"].items() if entry["quantizers"]]
    assert all(len(RECORDED["cases"][key].get("onnx_file_sha256", "")) == 64 for key in exported)
    # w8a8_dynamic quantizes only linears: the decoder has none, builds no quantizer and exports nothing
    assert sorted(set(RECORDED["cases"]) - set(exported)) == ["conv_transpose_decoder/w8a8_dynamic/none"]


@pytest.mark.parametrize(("name", "preset", "smooth"), [
    pytest.param(*case, id="-".join(case), marks=() if case in DEFAULT_CASES else pytest.mark.slow) for case in CASES])
def test_zoo_case_builds_the_recorded_quantizers_and_writes_the_recorded_onnx_file(
        name: str, preset: str, smooth: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    expected = RECORDED["cases"][f"{name}/{preset}/{smooth}"]
    current = fingerprint(name, preset, smooth, tmp_path)
    assert [[q, spec_key(spec)] for q, spec in current["quantizers"]] == expected["quantizers"]
    assert all(RECORDED["specs"][spec_key(spec)] == spec for _, spec in current["quantizers"] if spec != "derived")
    assert current.get("onnx_graph_sha256") == expected.get("onnx_graph_sha256")
    assert current.get("onnx_file_sha256") == expected.get("onnx_file_sha256")
    assert current.get("eager_output_sha256") == expected.get("eager_output_sha256")
