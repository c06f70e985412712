"""Which quantizer serves each annotated point: union-find over node outputs and edges (PT2E style).

A *point* is a node's output tensor ``(node,)`` or an edge ``(producer, consumer)``
(:mod:`~coreai_opt.graph.node_meta`). Points that share one quantizer form a group; the rules, applied in
this order, are:

1. A :class:`SharedSpec` joins its point with the point it names (a node names its output). A shared input
   edge also joins its producer's output: the op (``cat``) moves values that are already on the grid, and a
   value-moving op's output (reshape, max-pool, ...) shares its input's quantizer the same way.
2. A group's spec is its first output request in graph order: the producer decides.
3. A :class:`QuantSpec` edge ``(p, c)`` joins ``p``'s output group when that group has no spec yet (the first
   reader decides, e.g. for a graph input), has an equal spec (or refines it: softmax's fixed [0, 1] range
   serves a reader asking for the plain activation spec), or already contains ``c`` (``cat``: its inputs
   and output share). Otherwise the edge is *split off*: the edges reading ``p``'s group that want the same
   spec share one quantizer of their own, which reads the **float** tensor, so a uint16 reader of a uint8
   tensor really gets 16 bits. An ``edge_only`` request (a dynamic quantizer) is always split off: only the
   requesting edges read it.
4. A per-channel or per-block request (a weight) is laid out for the tensor its reader reads. It joins a
   producer group that has no spec yet only when that group is the producer's tensor alone; a group that also
   holds value-moving ops (``F.batch_norm`` over a ``[1, C, K]`` view of a conv weight, then ``reshape_as``:
   NFNet's weight standardisation; a transposed weight) holds the values in other layouts, where the axis
   names other channels, so the edge is split off and its quantizer reads the tensor the reader reads. Such
   split-off edges share a quantizer only when they read the same node: the row slices of a packed weight
   (``nn.MultiheadAttention``'s ``in_proj_weight`` split into ``w_q`` and ``w_kv`` when the query is not the
   key, as in an attention-pooling head) each get their own, with the same per-row scales the whole would have.
5. A per-channel or per-block *activation* group does not cross a value-moving op that moves elements to
   other qparams (``flatten`` of the channel axis into features, a ``permute`` that moves the axis, a slice
   along it; :func:`~coreai_opt.graph.mover_layouts.keeps_qparam_layout`): the same module called on the
   mover's output would apply its axis to another shape (``qparam shape changed from (8,) to (288,)``) or to
   other channels. Such a mover's output is a point of its own, so it is *requantized*: a reader's request
   gets a quantizer laid out for the mover's output (``Q_c(x) -> flatten -> Q_f``, ``Q_f`` per feature). A
   mover that keeps every element under its qparam (max-pool, dropout, a reshape keeping the axis) still
   shares, and per-tensor groups share across every mover as before.

A tensor whose readers all want one spec therefore keeps exactly one quantizer, which every reader reads
(readers without a request included), as before per-edge ownership.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from torch.fx import Node

from coreai_opt.graph.mover_layouts import keeps_qparam_layout
from coreai_opt.graph.node_meta import DerivedSpec, QuantSpec, Role, SharedSpec, get_meta
from coreai_opt.graph.union_find import UnionFind

__all__ = ["Edge", "QuantizerGroup", "QuantizerPlan", "plan_quantizers"]

Edge = tuple[Node, Node]
Point = tuple[Node] | tuple[Node, Node]


def _point(ref: Node | Edge) -> Point:
    return (ref,) if isinstance(ref, Node) else tuple(ref)


@dataclass
class QuantizerGroup:
    """Points served by one quantizer module.

    Attributes:
        spec: The request that decided the group's spec.
        requester: The node whose annotation made that request.
        outputs: Nodes whose output point is in the group (graph order): the quantizer is called on them.
        edges: Split-off edges ``(p, c)`` (``p``'s output is served by another group or by none): the quantizer
            is called on the float ``p`` and only ``c`` reads that call.
    """

    spec: QuantSpec
    requester: Node
    outputs: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)


@dataclass
class QuantizerPlan:
    """The grouping of one annotated graph.

    Attributes:
        groups: One entry per quantizer module to build, in the order their specs were decided.
        edge_groups: The group serving every requested edge.
        output_groups: The group of every node's output point (also groups without a spec: None).
        tensor_members: For every node with an output point, the nodes whose outputs share its group (graph
            order), also when the group has no spec.
        followers: Nodes whose output shares another point's quantizer (value-moving ops, ``cat``).
        biases: ``(bias, op, DerivedSpec)`` for every derived int32 bias request.
    """

    groups: list[QuantizerGroup]
    edge_groups: dict[Edge, QuantizerGroup]
    output_groups: dict[Node, QuantizerGroup | None]
    tensor_members: dict[Node, list[Node]]
    followers: set[Node]
    biases: list[tuple[Node, Node, DerivedSpec]]


def plan_quantizers(nodes: list[Node]) -> QuantizerPlan:
    """Group the annotated points of ``nodes`` (graph order) into quantizers (rules in the module docstring).

    Rule 5 needs the groups' specs to know which movers leave, so the grouping runs again without them; each
    run only ever detaches more movers, so it ends.
    """
    detached: set[Node] = set()
    while True:
        plan = _plan(nodes, detached)
        leaving = _movers_off_layout(plan) - detached
        if not leaving:
            return plan
        detached |= leaving


def _movers_off_layout(plan: QuantizerPlan) -> set[Node]:
    """Rule 5: followers of a per-channel / per-block activation group that move elements to other qparams."""
    leaving = set()
    for node in plan.followers:
        group = plan.output_groups.get(node)
        output = get_meta(node).annotation.output
        if (group is None or group.spec.role is not Role.ACTIVATION or group.spec.spec.granularity.type_name
                == "per_tensor" or not isinstance(output, SharedSpec)):
            continue
        source = output.edge_or_node
        if not isinstance(source, Node) or not keeps_qparam_layout(node, source, group.spec.spec.granularity):
            leaving.add(node)
    return leaving


def _plan(nodes: list[Node], detached: set[Node]) -> QuantizerPlan:
    """One grouping run; ``detached`` movers get an output point of their own instead of sharing (rule 5)."""
    uf = UnionFind[Hashable]()
    followers: set[Node] = set()
    shared_edges: set[Point] = set()
    output_requests: list[tuple[Node, QuantSpec]] = []
    edge_requests: list[tuple[Edge, QuantSpec]] = []
    requested_edges: list[Edge] = []
    biases: list[tuple[Node, Node, DerivedSpec]] = []
    for node in nodes:
        annotation = get_meta(node).annotation
        if annotation is None:
            continue
        for arg, spec in annotation.inputs:
            edge = (arg, node)
            if isinstance(spec, QuantSpec):
                edge_requests.append((edge, spec))
                requested_edges.append(edge)
                uf.find((arg,))
            elif isinstance(spec, SharedSpec):
                target = _point(spec.edge_or_node)
                if len(target) == 2:
                    shared_edges.add(target)
                uf.union(target, edge)
                uf.union((arg,), edge)
                requested_edges.append(edge)
            else:
                biases.append((arg, node, spec))
        if isinstance(annotation.output, QuantSpec):
            output_requests.append((node, annotation.output))
            uf.find((node,))
        elif isinstance(annotation.output, SharedSpec) and node in detached:
            uf.find((node,))
        elif isinstance(annotation.output, SharedSpec):
            uf.union(_point(annotation.output.edge_or_node), (node,))
            followers.add(node)
    decided: dict[Hashable, tuple[QuantSpec, Node]] = {}
    for node, spec in output_requests:
        decided.setdefault(uf.find((node,)), (spec, node))
    split_roots: dict[tuple[Hashable, ...], Point] = {}
    moved = _roots_with_value_moving_members(uf, nodes)
    for (producer, consumer), spec in edge_requests:
        _assign_edge(uf, decided, split_roots, shared_edges, (producer, consumer), spec, moved)
    return _build(nodes, uf, decided, followers, requested_edges, biases)


def _roots_with_value_moving_members(uf: UnionFind[Hashable], nodes: list[Node]) -> set[Hashable]:
    """Roots of the output groups that hold more than one node's output (a tensor and its value-moving views)."""
    count: dict[Hashable, int] = {}
    for node in nodes:
        if (node,) in uf.parent:
            root = uf.find((node,))
            count[root] = count.get(root, 0) + 1
    return {root for root, n in count.items() if n > 1}


def _assign_edge(
    uf: UnionFind[Hashable],
    decided: dict[Hashable, tuple[QuantSpec, Node]],
    split_roots: dict[tuple[Hashable, ...], Point],
    shared_edges: set[Point],
    edge: Edge,
    spec: QuantSpec,
    moved: set[Hashable],
) -> None:
    """Rules 3 and 4: join ``edge`` to its producer's output group, or to the split-off group of its spec."""
    producer, consumer = edge
    tensor, point = uf.find((producer,)), uf.find(edge)
    if tensor == point:
        decided.setdefault(tensor, (spec, consumer))
        return
    owner = decided.get(tensor)
    shares = (consumer,) in uf.parent and uf.find((consumer,)) == tensor
    per_layout = spec.spec.granularity.type_name != "per_tensor" and tensor in moved  # rule 4
    free = owner is None and not per_layout
    if not spec.edge_only and (free or (owner is not None and owner[0].satisfies(spec)) or shares
                               or edge in shared_edges):
        absorbed = decided.pop(point, None)
        uf.union(tensor, point)
        if tensor not in decided:
            decided[tensor] = absorbed or (spec, consumer)
        return
    key = (tensor, spec, producer) if per_layout else (tensor, spec)
    if key in split_roots:
        uf.union(split_roots[key], point)
    else:
        split_roots[key] = point
        decided[point] = (spec, consumer)


def _build(
    nodes: list[Node],
    uf: UnionFind[Hashable],
    decided: dict[Hashable, tuple[QuantSpec, Node]],
    followers: set[Node],
    requested_edges: list[Edge],
    biases: list[tuple[Node, Node, DerivedSpec]],
) -> QuantizerPlan:
    by_root = {root: QuantizerGroup(spec, requester) for root, (spec, requester) in decided.items()}
    output_groups: dict[Node, QuantizerGroup | None] = {}
    tensor_members: dict[Hashable, list[Node]] = {}
    for node in nodes:
        if (node,) in uf.parent:
            root = uf.find((node,))
            tensor_members.setdefault(root, []).append(node)
            output_groups[node] = by_root.get(root)
            if root in by_root:
                by_root[root].outputs.append(node)
    edge_groups: dict[Edge, QuantizerGroup] = {}
    for edge in requested_edges:
        root = uf.find(edge)
        if root not in by_root:
            continue
        group = edge_groups[edge] = by_root[root]
        if uf.find((edge[0],)) != root and edge not in group.edges:
            group.edges.append(edge)
    members = {node: tensor_members[uf.find((node,))] for node in output_groups}
    return QuantizerPlan(list(by_root.values()), edge_groups, output_groups, members, followers, biases)
