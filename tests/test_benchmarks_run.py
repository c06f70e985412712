"""``python -m benchmarks.run NAME``: the study registry, its errors, and the one-results-file-per-study writer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.common.results_file import write_part
from benchmarks.common.study import BENCHMARKS

STUDY_FOLDERS = sorted(p.parent.name for p in BENCHMARKS.glob("*/__init__.py") if p.parent.name != "common")


def test_the_registry_holds_every_study_folder_and_names_each_by_its_folder() -> None:
    assert sorted(run.STUDIES) == STUDY_FOLDERS == [
        "audit", "auto", "comparison", "corpus", "demo", "export_cost", "llm", "llm_memory", "llm_quality", "llm_speed",
        "matmul_nbits", "memory", "minilm", "sweep", "verify"]
    for name, study in run.STUDIES.items():
        assert study.name == name
        assert study.results == BENCHMARKS / name / "RESULTS.md"


def test_list_prints_every_study_with_what_it_measures_and_how_long(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    for study in run.STUDIES.values():
        assert f"{study.name}\n    measures: {study.measures}\n    takes: {study.duration}" in out


def test_no_name_lists_the_studies_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main([]) == 2
    assert "comparison\n    measures:" in capsys.readouterr().out


def test_an_unknown_name_is_rejected_with_the_known_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run.main(["speed"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown study 'speed'; the studies are: comparison, minilm, matmul_nbits, corpus, auto, memory" in err


def test_a_study_rejects_an_option_of_another_study(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.main(["auto", "--only", "accuracy"])
    assert "unrecognized arguments: --only accuracy" in capsys.readouterr().err


def test_only_run_py_is_an_entry_point() -> None:
    mains = [str(path.relative_to(BENCHMARKS)) for path in BENCHMARKS.rglob("*.py")
             if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                    for node in ast.parse(path.read_text()).body)]
    assert mains == ["run.py"]


def test_every_results_file_sits_in_its_study_folder() -> None:
    found = sorted(str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("RESULTS*.md"))
    assert found == ["audit/RESULTS.md", "auto/RESULTS.md", "comparison/RESULTS.md", "export_cost/RESULTS.md",
                     "llm/RESULTS.md",
                     "llm_memory/RESULTS.md", "llm_quality/RESULTS.md", "llm_speed/RESULTS.md", "memory/RESULTS.md",
                     "minilm/RESULTS.md", "sweep/RESULTS.md", "verify/RESULTS.md"]


def test_write_part_replaces_only_its_own_block(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# MiniLM\n\nintro\n")
    write_part(path, "w8a8", "old w8a8")
    write_part(path, "int4-eager", "eager table")
    write_part(path, "w8a8", "new w8a8\n")
    assert path.read_text() == ("# MiniLM\n\nintro\n\n<!-- part w8a8 -->\nnew w8a8\n<!-- /part w8a8 -->\n\n"
                                "<!-- part int4-eager -->\neager table\n<!-- /part int4-eager -->\n")


def test_write_part_refuses_a_block_without_its_end_marker(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("<!-- part w8a8 -->\nhand edited\n")
    with pytest.raises(ValueError, match="no '<!-- /part w8a8 -->': restore the end marker or delete the block"):
        write_part(path, "w8a8", "table")
    assert path.read_text() == "<!-- part w8a8 -->\nhand edited\n"


def test_minilm_sentences_are_read_from_the_repository_tests_data() -> None:
    """The MiniLM studies (minilm, auto) read their sentences from tests/data wherever the harness module lives."""
    from benchmarks.minilm import harness

    calibration, held_out = harness.read_sentences("calibration"), harness.read_sentences("eval")
    assert harness.DATA_DIR == BENCHMARKS.parent / "tests" / "data"
    assert len(calibration) == 64 and len(held_out) == 200 and not set(calibration) & set(held_out)
