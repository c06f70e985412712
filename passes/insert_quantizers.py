"""Turn annotations into quantizer modules: one ``FakeQuantize`` per group of tensors that share it.

Every requested edge ``(producer, consumer)`` is the producer's output tensor, so one tensor read by
several consumers gets one quantizer. :class:`~coreai_opt.passes.node_meta.SharedSpec` requests merge
tensors into groups with union-find (path compression); a group's spec is the first *output* request in
graph order (the producer decides), else the first input request. Exactly one quantizer module is built per
group and called right after each group member that produces values (a *source*). Members whose output is
a :class:`SharedSpec` (reshape, max-pool, cat, ...) only move values that are already on the grid; the same
module is called once more on such a tensor where it leaves the group (a user outside the group), which
changes no value (``Q(Q(x)) = Q(x)``) but gives onnxruntime the ``DQ → op → Q`` pattern it needs to run
MaxPool/Reshape/Concat on integers and to fuse the consumer (``DQ → Conv``).

A :class:`~coreai_opt.passes.node_meta.DerivedSpec` bias gets a ``BiasFakeQuantize`` fed by ``get_attr``
of the input and weight quantizers' ``calculator.scale`` buffers: ``s_b = s_in · s_w``, never observed.
Quantizer names follow the tensor they serve (``layer1.0.conv1.weight``); annotations are cleared.
"""

from __future__ import annotations

import re
from dataclasses import replace

from torch.fx import GraphModule, Node

from coreai_opt.passes.node_meta import (
    DerivedSpec,
    NodeMeta,
    QuantizerInfo,
    QuantSpec,
    Role,
    SharedSpec,
    copy_provenance,
    get_meta,
    set_meta,
    tensor_info,
)
from coreai_opt.passes.op_kinds import OpKind
from coreai_opt.passes.pass_result import PassResult
from coreai_opt.quantization.spec import (
    FAKE_QUANTIZE,
    BiasFakeQuantize,
    PerTensor,
    StatefulQParamsCalculatorBase,
)

__all__ = ["insert_quantizers"]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, x: Node) -> Node:
        root = x
        while self.parent.setdefault(root, root) is not root:
            root = self.parent[root]
        while self.parent[x] is not root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra


def _serves(node: Node, role: Role) -> str:
    meta = get_meta(node)
    if node.op == "get_attr":
        return str(node.target)
    if node.op == "placeholder":
        return f"{node.target}.input"
    if meta.module_name and meta.module_type is not None and meta.module_type.__module__.startswith("torch.nn"):
        return f"{meta.module_name}.output"
    return f"{meta.module_name}.{node.name}" if meta.module_name else f"{node.name}.output"


def _attr_name(gm: GraphModule, serves: str, role: Role) -> str:
    base = re.sub(r"\W+", "_", serves).strip("_") + ("_fq" if role is not Role.BIAS else "_bias_fq")
    base = f"_{base}" if base[0].isdigit() else base  # a valid Python identifier for the generated code
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _insert_call(
    gm: GraphModule, module: str, anchor: Node, args: tuple, info: QuantizerInfo, after: bool, source: Node
) -> Node:
    """Call quantizer ``module`` on ``args`` after (or before) ``anchor``; provenance comes from ``source``."""
    if after and anchor.op == "placeholder":  # keep placeholders first
        anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(anchor) if after else gm.graph.inserting_before(anchor):
        call = gm.graph.call_module(module, args)
    copy_provenance(source, call)
    set_meta(call, NodeMeta(kind=OpKind.QUANTIZE, module_name=get_meta(source).module_name,
                            module_type=get_meta(source).module_type, quantizer=info))
    return call


def insert_quantizers(gm: GraphModule) -> PassResult:
    """Insert one quantizer per group of annotated tensors and the derived int32 bias quantizers.

    Args:
        gm: An annotated GraphModule (``annotate`` ran).

    Returns:
        ``PassResult`` counting inserted quantizer calls.

    Raises:
        ValueError: the graph was not annotated, or a spec does not fit the tensor it quantizes (names it).
    """
    nodes = list(gm.graph.nodes)
    if any(get_meta(n).kind is None for n in nodes):
        raise ValueError("insert_quantizers needs classified, annotated nodes; run classify_ops and annotate first")
    groups = _UnionFind()
    followers: set[Node] = set()
    output_requests: list[tuple[Node, QuantSpec, Node]] = []
    input_requests: list[tuple[Node, QuantSpec, Node]] = []
    biases: list[tuple[Node, Node, DerivedSpec]] = []
    for node in nodes:
        annotation = get_meta(node).annotation
        if annotation is None:
            continue
        for arg, spec in annotation.inputs:
            if isinstance(spec, QuantSpec):
                input_requests.append((arg, spec, node))
            elif isinstance(spec, SharedSpec):
                groups.union(spec.edge_or_node if isinstance(spec.edge_or_node, Node) else spec.edge_or_node[0], arg)
            else:
                biases.append((arg, node, spec))
        if isinstance(annotation.output, QuantSpec):
            output_requests.append((node, annotation.output, node))
        elif isinstance(annotation.output, SharedSpec):
            target = annotation.output.edge_or_node
            groups.union(target if isinstance(target, Node) else target[0], node)
            followers.add(node)
    chosen: dict[Node, tuple[QuantSpec, Node]] = {}
    for tensor, spec, requester in output_requests + input_requests:
        chosen.setdefault(groups.find(tensor), (spec, requester))
    members: dict[Node, list[Node]] = {}
    exits: dict[Node, list[Node]] = {}
    for node in nodes:
        if node in groups.parent and node not in followers:
            members.setdefault(groups.find(node), []).append(node)
        elif node in followers and tensor_info(node) is not None and any(u not in followers for u in node.users):
            exits.setdefault(groups.find(node), []).append(node)
    quantizer_of: dict[Node, str] = {}
    used: set[str] = set()
    changes = 0
    for root, (qspec, requester) in chosen.items():
        sources = members.get(root, [])
        if not sources:
            continue
        first = sources[0]
        role = qspec.role
        serves = _serves(first, role)
        if serves in used:  # a module called at several sites (a shared nn.ReLU): number the call sites
            stem, _, tail = serves.rpartition(".")
            k = sum(u.startswith(f"{stem}[") for u in used) + 1
            serves = f"{stem}[{k}].{tail}"
        used.add(serves)
        op_kind = get_meta(requester).kind if role is Role.WEIGHT else get_meta(first).kind
        fq = FAKE_QUANTIZE.get_class(qspec.spec.fake_quantize).from_spec(qspec.spec)
        fq.set_name(serves)
        shape = _tensor_shape(gm, first)
        if shape is not None and (-1 not in shape or isinstance(qspec.spec.granularity, PerTensor)):
            try:
                fq.initialize(shape)
            except ValueError as exc:
                raise ValueError(f"quantizer for {serves} ({first.format_node()}): {exc}") from exc
        name = _attr_name(gm, serves, role)
        gm.add_submodule(name, fq)
        info = QuantizerInfo(name, role, serves, op_kind or OpKind.OTHER)
        for source in sources + exits.get(root, []):
            call = _insert_call(gm, name, source, (source,), info, after=True, source=source)
            source.replace_all_uses_with(call, delete_user_cb=lambda user, call=call: user is not call)
            changes += 1
        quantizer_of[root] = name
    for bias, op, derived in biases:
        changes += _insert_bias(gm, bias, op, derived, groups, quantizer_of, used)
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.annotation is not None:
            set_meta(node, replace(meta, annotation=None))
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changes)


def _tensor_shape(gm: GraphModule, node: Node) -> tuple[int, ...] | None:
    if node.op == "get_attr":
        owner, _, attr = str(node.target).rpartition(".")
        return tuple(getattr(gm.get_submodule(owner), attr).shape)
    info = tensor_info(node)
    return info[0] if info else None


def _insert_bias(
    gm: GraphModule,
    bias: Node,
    op: Node,
    derived: DerivedSpec,
    groups: _UnionFind,
    quantizer_of: dict[Node, str],
    used: set[str],
) -> int:
    """Insert the int32 bias quantizer of ``op``; record a reason and return 0 when it cannot be derived.

    A module called at several sites gets one bias quantizer per call, numbered like the other quantizers
    (``l.bias``, ``l[1].bias``, ...); ``used`` holds the names taken so far and is updated.
    """
    names = [quantizer_of.get(groups.find(n)) for n in derived.derived_from]
    reason = None
    if None in names:
        reason = "bias left float: the input or weight quantizer was not created"
    else:
        in_fq = gm.get_submodule(names[0])
        if not isinstance(in_fq.calculator, StatefulQParamsCalculatorBase) or not isinstance(
                gm.get_submodule(names[1]).calculator, StatefulQParamsCalculatorBase):
            reason = "bias left float: a dynamic (stateless) quantizer has no scale buffer to derive from"
        elif not isinstance(in_fq.spec.granularity, PerTensor) or in_fq.spec.dtype_info.is_float:
            reason = "bias left float: the input quantizer is not an integer per-tensor quantizer"
    if reason is not None:
        meta = get_meta(op)
        reason = f"{meta.module_name or op.name} {reason}"
        set_meta(op, replace(meta, float_reason=f"{meta.float_reason}; {reason}" if meta.float_reason else reason))
        return 0
    serves = str(bias.target)
    if serves in used:  # a module called at several sites: number the call sites (l.bias, l[1].bias, ...)
        stem, _, tail = serves.rpartition(".")
        k = sum(u.startswith(f"{stem}[") and u.endswith(f"].{tail}") for u in used) + 1
        serves = f"{stem}[{k}].{tail}"
    used.add(serves)
    name = _attr_name(gm, serves.removesuffix(".bias") if serves.endswith(".bias") else serves, Role.BIAS)
    bq = BiasFakeQuantize()
    bq.set_name(serves)
    gm.add_submodule(name, bq)
    with gm.graph.inserting_before(op):
        scales = [gm.graph.get_attr(f"{n}.calculator.scale") for n in names]
    for s in scales:
        set_meta(s, NodeMeta(kind=OpKind.PARAMETER))
    info = QuantizerInfo(name, Role.BIAS, serves, get_meta(op).kind)
    call = _insert_call(gm, name, op, (bias, *scales), info, after=False, source=bias)
    op.replace_input_with(bias, call)
    return 1
