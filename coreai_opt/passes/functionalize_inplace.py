"""Turn every in-place op into its out-of-place form, so later passes can rewire and delete nodes freely.

An in-place node ``n = t.add_(y)`` writes into the tensor of node ``t``: every node that reads ``t`` *after*
``n`` sees the new value, and ``n`` returns ``t`` itself. After this pass::

    n' = t.add(y)            # the out-of-place form (see :mod:`.inplace_ops`)
    readers of t after n  -> read n'
    readers of n          -> read n'

which computes the same values with no writes, so inserting a quantizer on ``t`` or deleting an unused node can
no longer change what later readers see. It runs right after capture, before any other pass.

Aliasing. The rewrite is exact when ``t`` is the only name of its storage that is read after ``n``. When another
view or alias of the same storage (``v = t.view(-1)`` made before ``n``, or ``t`` itself being ``base[:, 0]``)
is read after ``n``, the write would have to be replayed into those views; the pass raises
:class:`~coreai_opt.graph.capture_error.InplaceAliasError` naming the node and its source line instead (capture
then falls back to ``torch.export``, which functionalizes views itself). Whether a node may alias its input
comes from :func:`~coreai_opt.graph.op_effects.may_alias_input`, which says "may" for every op it does not know.

Two kinds of writes are left as they are: writes into module state (a buffer or parameter reached through
``get_attr``: the write is the point, e.g. a step counter) and writes that only change shape metadata (``t_``,
``unsqueeze_``: rewired like the others, they cannot affect other views). Writes into a graph input become out of
place: the prepared model computes the same outputs but no longer modifies the caller's tensor.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from coreai_opt.graph.capture_error import CaptureError, InplaceAliasError, source_of
from coreai_opt.graph.inplace_ops import (
    InplaceWrite,
    NoOutOfPlaceForm,
    check_out_of_place,
    inplace_write,
    out_of_place,
    plain_operator,
)
from coreai_opt.graph.op_effects import is_pure, may_alias_input
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.union_find import UnionFind

__all__ = ["functionalize_inplace"]


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if a.op != "output"]


def _storages(gm: GraphModule, nodes: list[Node], writes: dict[Node, InplaceWrite]) -> UnionFind[Node]:
    """Sets of nodes that may share storage (a view and its base, an in-place result and its target)."""
    storages: UnionFind[Node] = UnionFind()
    for node in nodes:
        storages.find(node)
        if node in writes:
            storages.union(writes[node].target, node)
        elif may_alias_input(gm, node):
            for arg in _tensor_inputs(node):
                storages.union(arg, node)
    return storages


def _label(node: Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = source_of(node)
    return f"'{target}' (node {node.name}{', at ' + where if where else ''})"


def _alias_problem(write: InplaceWrite, members: list[Node], same: dict[Node, Node],
                   position: dict[Node, int]) -> str | None:
    """Describe the first other view of the written storage that is read after the write, if any."""
    node, target = write.node, write.target
    for member in members:
        if same[member] is same[target] or position[member] >= position[node]:
            continue
        late = [u for u in member.users if position[u] > position[node]]
        if late:
            return (f"in-place op {_label(node)} writes into storage shared with '{member.name}' (a view or alias "
                    f"of it), and '{late[0].name}' reads '{member.name}' after the write")
    return None


def _check_aliasing(gm: GraphModule, nodes: list[Node], writes: dict[Node, InplaceWrite]) -> set[Node]:
    """Raise on writes through a live alias; return the writes into module state (kept as they are)."""
    position = {n: i for i, n in enumerate(nodes)}
    storages = _storages(gm, nodes, writes)
    members: dict[Node, list[Node]] = {}
    for node in nodes:
        members.setdefault(storages.find(node), []).append(node)
    same = {n: n for n in nodes}  # in-place results are the very tensor they write into
    for node in nodes:
        if node in writes:
            same[node] = same[writes[node].target]
    state: set[Node] = set()
    for node, write in writes.items():
        group = members[storages.find(write.target)]
        if any(m.op == "get_attr" for m in group):
            state.add(node)
            continue
        problem = None if write.metadata_only else _alias_problem(write, group, same, position)
        if problem:
            raise InplaceAliasError(
                f"{problem}; a captured graph cannot replay that write into every view. Fix: let torch.export "
                "functionalize it (capture='auto' or capture='export'), or write it out of place "
                "(y = y + ... instead of y += ..., torch.cat instead of writing into a slice)"
            )
    return state


def _rewire(write: InplaceWrite, value: Node, position: dict[Node, int]) -> None:
    """Make every reader of the written tensor after the write, and every reader of the write, read ``value``."""
    node, target = write.node, write.target
    for user in list(target.users):
        if user is not value and user is not node and position.get(user, -1) > position[node]:
            user.replace_input_with(target, value)
    if value is not node:
        node.replace_all_uses_with(value)


def _copy_meta(src: Node, dst: Node) -> None:
    for key in ("tensor_meta", "val", "nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def functionalize_inplace(gm: GraphModule) -> PassResult:
    """Replace every in-place op of ``gm`` by its out-of-place form (see the module docstring).

    Args:
        gm: A freshly captured GraphModule (FX or export).

    Returns:
        ``PassResult`` counting the rewritten in-place nodes.

    Raises:
        InplaceAliasError: a write goes through a view or alias that is read after it (the node is named).
        CaptureError: a write has no out-of-place form (``resize_``, random fills).

    Example:
        >>> import torch
        >>> class Residual(torch.nn.Module):
        ...     def forward(self, x):
        ...         y = x * 2
        ...         y.add_(x)          # result unused: the write is the point
        ...         return y
        >>> gm = torch.fx.symbolic_trace(Residual())
        >>> functionalize_inplace(gm).changes, [str(n.target) for n in gm.graph.nodes][1:]
        (1, ['<built-in function mul>', 'add', 'output'])
    """
    nodes = list(gm.graph.nodes)
    plain = {n: op for n in nodes if (op := plain_operator(n)) is not None}
    for node, op in plain.items():  # ``n += 1`` on an int size
        node.target = op
    writes = {n: w for n in nodes if (w := inplace_write(gm, n)) is not None}
    if not writes:
        if plain:
            gm.recompile()
        return PassResult(gm, len(plain))
    state = _check_aliasing(gm, nodes, writes)
    rewritten = [w for n, w in writes.items() if n not in state]
    for write in rewritten:  # every check before the first change (module flags are shared with the model copy)
        try:
            check_out_of_place(gm, write)
        except NoOutOfPlaceForm as exc:
            where = source_of(write.node)
            raise CaptureError(f"{exc}{', at ' + where if where else ''}; write it out of place or keep the code in "
                               "a leaf module (leaf_modules=[...])") from exc
    position = {n: i for i, n in enumerate(nodes)}
    changes = 0
    for write in rewritten:
        node = write.node
        value = out_of_place(gm, write)
        for new in (value, *value.all_input_nodes):
            if new not in position:
                position[new] = position[node]
                _copy_meta(node, new)
        _rewire(write, value, position)
        if value is not node:
            gm.graph.erase_node(node)
            if not value.users and is_pure(gm, value):  # a write nothing reads again (into a graph input)
                gm.graph.erase_node(value)
        changes += 1
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changes + len(plain))
