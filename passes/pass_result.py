"""The value every graph pass returns."""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import GraphModule

__all__ = ["PassResult"]


@dataclass(frozen=True)
class PassResult:
    """Result of one pass over a GraphModule the pipeline owns.

    Attributes:
        graph_module: The module to use from now on (passes mutate in place and return it).
        changes: Honest count of edits (nodes rewritten, inserted or removed); 0 means untouched.
    """

    graph_module: GraphModule
    changes: int

    @property
    def modified(self) -> bool:
        """True when the pass changed anything."""
        return self.changes > 0
