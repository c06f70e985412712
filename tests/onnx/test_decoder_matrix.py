"""The decoder matrix (issue 32): 8 families x w4 / w8 / w8a8_dynamic as KV-cache decoder files.

Each cell quantizes a tiny random ``save_pretrained`` folder through the Python API path of ``coreai-opt quantize
--task text-generation`` and generates 32 greedy tokens after each of 8 prompts: eager vs onnxruntime and, in
onnxruntime, with the cache vs regenerating from scratch must agree token for token, or differ only at near-ties
(margin below twice the file's derived logits tolerance), at most 1 in 256 tokens. One GPT-2 cell runs through the
console command. About 1-2 min a cell on the shared 2-core machine, so the matrix runs under the ``llm`` marker:
``pytest -m llm tests/onnx/test_decoder_matrix.py``.

Known failure (xfail, not strict): w8a8_dynamic with vs without the cache. Its ``DynamicQuantizeLinear`` takes one
activation scale per tensor over every token of the call, so a decode step (one token) and a regeneration (the
whole sequence) quantize a token differently; benchmarks/llm/RESULTS.md counts 0 to 9 flips per 256 tokens. It needs
a per-token dynamic activation quantizer (issue 32). Open (xfail, not strict): GPT-2 w4, eager vs onnxruntime, one
flip in 256 with a margin (0.0013) above the float bound (0.00024); its Conv1D linears export as DequantizeLinear +
Gemm, not MatMulNBits, and the difference is not yet explained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.llm.cells import Cell, run_cell, run_cli_cell
from benchmarks.llm.families import FAMILIES, save_family
from benchmarks.llm.matrix import PRESETS

_CELLS: dict[tuple[str, str], Cell] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


def _cell(family: str, preset: str, work: Path) -> Cell:
    """The cell, run once for both tests of it."""
    if (family, preset) not in _CELLS:
        directory = work / family
        if not directory.exists():
            save_family(family, directory)
        _CELLS[family, preset] = run_cell(directory, family, preset, work)
    cell = _CELLS[family, preset]
    assert cell.error is None, "\n".join([cell.error, *cell.details])
    assert cell.eager_vs_ort is not None and cell.cache_vs_no_cache is not None
    assert cell.eager_vs_ort.tokens == cell.cache_vs_no_cache.tokens == 8 * 32
    return cell


_GPT2_W4 = pytest.mark.xfail(reason="GPT-2 w4: one flip above the float bound, not yet explained (module docstring)",
                             strict=False)


@pytest.mark.llm
@pytest.mark.parametrize(("family", "preset"), [
    pytest.param(f, p, marks=_GPT2_W4) if (f, p) == ("gpt2", "w4") else (f, p) for f in FAMILIES for p in PRESETS])
def test_eager_and_onnxruntime_generate_the_same_tokens_up_to_near_ties(family: str, preset: str, work: Path) -> None:
    report = _cell(family, preset, work).eager_vs_ort
    assert report is not None and report.ok, str(report)


_DYNAMIC = pytest.mark.xfail(reason="w8a8_dynamic: one activation scale per tensor over all tokens of a call, so "
                                    "cached decoding and regeneration quantize differently (module docstring)",
                             strict=False)


@pytest.mark.llm
@pytest.mark.parametrize("preset", [p if p != "w8a8_dynamic" else pytest.param(p, marks=_DYNAMIC) for p in PRESETS])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_onnxruntime_generates_the_same_tokens_with_the_cache_and_from_scratch_up_to_near_ties(
        family: str, preset: str, work: Path) -> None:
    report = _cell(family, preset, work).cache_vs_no_cache
    assert report is not None and report.ok, str(report)


@pytest.mark.llm
def test_the_console_command_quantizes_gpt2_with_its_conv1d_linears_as_a_kv_cache_decoder(tmp_path: Path) -> None:
    code, record, _ = run_cli_cell(save_family("gpt2", tmp_path / "gpt2"), "gpt2", "w8", tmp_path)
    assert code == 0
    assert record["ok"] is True and record["tokens_identical"] == record["tokens"] == 4 * 32
    assert (tmp_path / "genai_config.json").exists()
