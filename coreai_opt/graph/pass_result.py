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

    @classmethod
    def after_edits(cls, gm: GraphModule, changes: int) -> PassResult:
        """The result of a pass that edited ``gm``'s graph in place: linted and recompiled when ``changes > 0``."""
        if changes:
            gm.graph.lint()
            gm.recompile()
        return cls(gm, changes)

    @property
    def modified(self) -> bool:
        """True when the pass changed anything."""
        return self.changes > 0
