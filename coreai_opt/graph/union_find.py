"""Union-find (disjoint sets with path compression) over hashable items: FX nodes, or points ``(node,)`` / edges.

One implementation for every pass that groups things: storages that may alias
(:mod:`coreai_opt.passes.functionalize_inplace`) and points that share a quantizer
(:mod:`coreai_opt.graph.quantizer_groups`). Items compare with ``==`` (an FX node equals only itself; a point
tuple equals another tuple of the same nodes).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["UnionFind"]

T = TypeVar("T", bound=Hashable)


class UnionFind(Generic[T]):
    """Disjoint sets: ``union(a, b)`` merges two sets keeping ``a``'s root, ``find(x)`` names ``x``'s set by its root.

    ``union`` never changes the root of ``a``'s set, so a table keyed by roots stays valid for that set.
    """

    def __init__(self) -> None:
        self.parent: dict[T, T] = {}

    def find(self, item: T) -> T:
        """The root of ``item``'s set (an item never seen before is a set of its own)."""
        root = item
        while self.parent.setdefault(root, root) != root:
            root = self.parent[root]
        while self.parent[item] != root:  # path compression
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a: T, b: T) -> T:
        """Merge the sets of ``a`` and ``b``; return the root of the merged set (``a``'s root)."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
        return ra
