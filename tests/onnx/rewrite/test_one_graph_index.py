"""Only rewrite/graph.py indexes ONNX graphs: no other module builds producer / reader maps or imports graph_index.

The check is syntactic and aimed at the idiom every hand-written index used: an iteration over ``<graph>.node``
with an inner iteration over ``<node>.input`` / ``<node>.output`` (a comprehension or nested ``for`` loops).
``test_the_index_detector_flags_the_old_hand_written_maps`` shows it catches the maps the passes had.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted((ROOT / "coreai_opt").rglob("*.py"))
INDEX_MODULE = ROOT / "coreai_opt" / "onnx" / "rewrite" / "graph.py"
_WRAPPERS = frozenset({"enumerate", "zip", "reversed", "list", "tuple", "sorted"})


def _iterates(node: ast.AST, attribute: str, over: str | None = None) -> bool:
    """``node`` (an iteration target expression) is ``<something>.<attribute>`` (of the name ``over``, if given),
    also wrapped in ``enumerate`` / ``zip`` / ``reversed`` / ``list`` / ``tuple`` / ``sorted``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _WRAPPERS:
        return any(_iterates(arg, attribute, over) for arg in node.args)
    return isinstance(node, ast.Attribute) and node.attr == attribute and (
        over is None or (isinstance(node.value, ast.Name) and node.value.id == over))


def _loop_variables(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _index_walks(tree: ast.AST) -> list[int]:
    """Line numbers where a walk over ``.node`` iterates the nodes' ``.input`` / ``.output``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            loops = node.generators
            for i, outer in enumerate(loops):
                if _iterates(outer.iter, "node"):
                    names = _loop_variables(outer.target)
                    if any(_iterates(inner.iter, kind, name) for inner in loops[i + 1:] for kind in ("input", "output")
                           for name in names):
                        found.append(node.lineno)
        if isinstance(node, ast.For) and _iterates(node.iter, "node"):
            names = _loop_variables(node.target)
            for inner in ast.walk(node):
                if isinstance(inner, (ast.For, ast.comprehension)) and inner is not node and any(
                        _iterates(inner.iter, kind, name) for kind in ("input", "output") for name in names):
                    found.append(node.lineno)
                    break
    return sorted(found)


def test_the_index_detector_flags_the_old_hand_written_maps() -> None:
    old_maps = '''
producers = {name: node for node in graph.node for name in node.output}
taken = {o for n in graph.node for o in n.output} | set(inits)
for node in graph.node:
    for name in node.input:
        readers.setdefault(name, []).append(node)
'''
    assert _index_walks(ast.parse(old_maps)) == [2, 3, 4]
    wrapped = "for node in list(graph.node):\n    for i, name in enumerate(node.input):\n        reads.add(name)"
    assert _index_walks(ast.parse(wrapped)) == [1]
    assert _index_walks(ast.parse("ops = [n.op_type for n in graph.node]\nfor n in graph.node:\n    n.input[0]")) == []


def test_no_module_but_the_rewrite_graph_indexes_an_onnx_graph() -> None:
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in SOURCES if path != INDEX_MODULE and (lines := _index_walks(ast.parse(path.read_text())))
    }
    assert offenders == {}, f"build producer / reader maps with coreai_opt.onnx.rewrite.graph.OnnxGraph: {offenders}"


def test_graph_index_is_gone_and_nothing_imports_it() -> None:
    assert not (ROOT / "coreai_opt" / "onnx" / "graph_index.py").exists()
    assert [str(p.relative_to(ROOT)) for p in SOURCES if "graph_index" in p.read_text()] == []
