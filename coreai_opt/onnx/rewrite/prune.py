"""``prune_unread``: remove at once what a rewrite left unread, so a replaced weight is freed site by site.

:func:`~coreai_opt.onnx.rewrite.rule.run_rules` removes dead nodes and initializers after each rule, which is
enough for the graph but not for memory: while ``write_matmul_nbits`` rewrites a 1.1 B decoder's 155 linears, every
replaced int4 weight stayed beside its packed successor until the rule ended (+0.58 GB at 22 layers). A rule calls
:func:`prune_unread` on the inputs it stopped reading; the file is the same, only the removal comes earlier.
"""

from __future__ import annotations

from collections.abc import Iterable

from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["prune_unread"]


def prune_unread(graph: OnnxGraph, names: Iterable[str]) -> None:
    """Remove each of ``names`` that nothing reads any more, with what only it kept alive.

    A value nobody reads (and that is not a graph output) loses its producer node once none of that node's outputs
    is read, then the same check runs on the node's inputs; an unread initializer is removed (and freed, when the
    rewrite wrote it). Graph inputs stay.
    """
    pending = [name for name in names if name]
    while pending:
        name = pending.pop()
        if graph.readers(name) or name in graph.outputs or name in graph.inputs:
            continue
        node = graph.producer(name)
        if node is None:
            graph.remove_unread([name])
        elif graph.contains(node) and not any(graph.readers(o) or o in graph.outputs for o in node.output if o):
            graph.remove(node)
            pending.extend(i for i in node.input if i)
