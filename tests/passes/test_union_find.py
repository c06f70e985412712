"""The one union-find (coreai_opt.graph.union_find) that storage aliasing and quantizer groups share."""

from __future__ import annotations

from torch import fx

from coreai_opt.graph.union_find import UnionFind


def _nodes(count: int) -> list[fx.Node]:
    graph = fx.Graph()
    return [graph.placeholder(f"x{i}") for i in range(count)]


def test_union_keeps_the_first_sets_root_and_find_compresses_the_path() -> None:
    a, b, c, d = _nodes(4)
    sets: UnionFind[fx.Node] = UnionFind()
    assert sets.union(c, d) is c
    assert sets.union(b, c) is b
    assert sets.union(a, b) is a
    assert sets.parent == {a: a, b: a, c: b, d: c}  # a chain before any find
    assert sets.find(d) is a
    assert sets.parent == {a: a, b: a, c: a, d: a}  # every node on the path now points at the root
    assert sets.union(d, a) is a  # already one set: nothing changes


def test_point_tuples_of_the_same_nodes_are_one_item_and_unseen_items_are_their_own_set() -> None:
    p, q = _nodes(2)
    points: UnionFind[tuple[fx.Node, ...]] = UnionFind()
    assert points.union((p,), (p, q)) == (p,)
    assert points.find((p, q)) == (p,)  # a new tuple with the same nodes finds the same set
    assert points.find((q,)) == (q,)
    assert len({points.find(x) for x in [(p,), (p, q), (q,)]}) == 2

