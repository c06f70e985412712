"""Source-level rules: graph metadata is read through one module, no private name crosses a module boundary."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "coreai_opt").rglob("*.py"))
#: The node-level (node_meta.py) and graph-level (graph_meta.py) accessors are the only readers of the key.
META_ACCESSORS = {ROOT / "coreai_opt" / "graph" / "node_meta.py", ROOT / "coreai_opt" / "graph" / "graph_meta.py"}


def _is_meta_key(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and node.value == "coreai_opt") or (
        isinstance(node, ast.Name) and node.id == "META_KEY")


def _meta_key_uses(tree: ast.AST) -> list[int]:
    """Lines that index ``<x>.meta`` with the coreai_opt key or call ``<x>.meta.get(<key>)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "meta" \
                and _is_meta_key(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "meta" \
                and node.args and _is_meta_key(node.args[0]):
            lines.append(node.lineno)
    return lines


def test_sources_are_found() -> None:
    assert len(LIBRARY) > 80 and all(path in LIBRARY for path in META_ACCESSORS)


def test_coreai_opt_metadata_is_read_only_through_the_accessor_modules() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in LIBRARY if path not in META_ACCESSORS
                 for line in _meta_key_uses(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_check_finds_a_metadata_read_by_string() -> None:
    code = 'a = gm.meta["coreai_opt"]["capture"]\nb = model.meta.get("coreai_opt")\nc = gm.meta[META_KEY]\n'
    assert sorted(_meta_key_uses(ast.parse(code))) == [1, 2, 3]


def test_no_private_name_is_imported_from_another_module() -> None:
    offenders = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coreai_opt"):
                offenders += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


SPEC_LAYER = ROOT / "coreai_opt" / "quantization"
#: FakeQuantize internals that callers reach only through its public API (get_qparams, observe, commit,
#: reset_statistics, stateful / has_qparams / has_statistics, exports_dynamic, rounds_with_data).
_INTERNALS = {"calculator"}


def _internal_reach_ins(tree: ast.AST) -> list[int]:
    """Lines reading ``<x>.calculator`` or probing ``getattr(<x>, "calculator" | "exports_dynamic" | "rounding")``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _INTERNALS:
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in {"calculator", "exports_dynamic", "rounding"}:
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_spec_layer_reaches_into_fake_quantize_internals() -> None:
    outside = [*LIBRARY, *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in outside if SPEC_LAYER not in path.parents
                 for line in _internal_reach_ins(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_check_finds_a_reach_in() -> None:
    code = 'a = fq.calculator.scale\nb = getattr(fq, "exports_dynamic", False)\nc = fq.get_qparams().scale\n'
    assert sorted(_internal_reach_ins(ast.parse(code))) == [1, 2]


#: Every Python file outside tests: the library, benchmarks, examples and any top-level script.
NON_TEST_SOURCES = sorted([*LIBRARY, *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
                           *ROOT.glob("*.py")])
MAX_FILE_LINES = 400
MAX_MEDIAN_LINES = 150


def _line_counts(paths: list[Path]) -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in paths}


def _over_limit(counts: dict[str, int]) -> list[str]:
    """``"<file>: <lines>"`` for every file over :data:`MAX_FILE_LINES`, longest first."""
    return [f"{name}: {lines}" for name, lines in sorted(counts.items(), key=lambda kv: -kv[1])
            if lines > MAX_FILE_LINES]


def test_no_source_file_outside_tests_is_over_400_lines() -> None:
    offenders = _over_limit(_line_counts(NON_TEST_SOURCES))
    assert offenders == [], f"split along their seams (at most {MAX_FILE_LINES} lines each): {offenders}"


def test_the_median_source_file_outside_tests_is_at_most_150_lines() -> None:
    counts = _line_counts(NON_TEST_SOURCES)
    median = statistics.median(counts.values())
    largest = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
    assert len(counts) > 150 and median <= MAX_MEDIAN_LINES, (
        f"median {median} lines over {len(counts)} files (at most {MAX_MEDIAN_LINES}); the largest: {largest}")


def test_the_size_check_names_a_file_over_400_lines() -> None:
    assert _over_limit({"a.py": 400, "b.py": 401, "c.py": 612}) == ["c.py: 612", "b.py: 401"]
