"""Union-find over FX nodes (disjoint sets with path compression)."""

from __future__ import annotations

from torch.fx import Node

__all__ = ["NodeSets"]


class NodeSets:
    """Disjoint sets of nodes: ``union(a, b)`` merges two sets, ``find(n)`` names the set of ``n`` by a root node."""

    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, node: Node) -> Node:
        """The root of ``node``'s set (a node never seen before is a set of its own)."""
        root = node
        while self.parent.setdefault(root, root) is not root:
            root = self.parent[root]
        while self.parent[node] is not root:  # path compression
            self.parent[node], node = root, self.parent[node]
        return root

    def union(self, a: Node, b: Node) -> None:
        """Merge the sets of ``a`` and ``b`` (``a``'s root stays the root)."""
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra
