"""Turn annotations into quantizer modules: one ``FakeQuantize`` per group of points that share it.

:func:`~coreai_opt.graph.quantizer_groups.plan_quantizers` groups the annotated points (node outputs and
edges ``(producer, consumer)``) by union-find; this pass builds one quantizer module per group and calls it:

* on the *outputs* of a group: right after each member that produces values (a *source*); every reader then
  reads the quantized value unless its own edge is served by another group. Members whose output is a
  :class:`~coreai_opt.graph.node_meta.SharedSpec` (reshape, max-pool, cat, ...) only move values that are
  already on the grid; the module is called once more on such a tensor where it leaves the group (a user
  outside the group), which changes no value (``Q(Q(x)) = Q(x)``) but gives onnxruntime the
  ``DQ → op → Q`` pattern it needs to run MaxPool/Reshape/Concat on integers and to fuse the consumer. A
  member that returns its input unchanged (``nn.Identity``, a dropout in eval mode or with ``p = 0``: see
  :func:`_is_identity`) gets no such call: the export emits no op for it, so the call would only be a second,
  identical ``QuantizeLinear → DequantizeLinear`` pair on the same edge (timm's ``BatchNormAct2d.drop``); the
  member it reads is called instead when that one moves values (``x[:, 0] → dropout → linear``: ``Gather → Q``);
* on *split-off edges* ``(p, c)``: once per producer ``p``, on the float value of ``p`` (value-moving ops
  between ``p``'s source and ``p`` are replayed on the float source when ``p``'s group is quantized), read by
  those consumers only. Such a quantizer serves ``"<tensor>@<consumer>"`` when the tensor has a quantizer of
  its own (a uint16 reader of a uint8 tensor), else the tensor's name (a dynamic linear input).

A :class:`~coreai_opt.graph.node_meta.DerivedSpec` bias gets a ``BiasFakeQuantize`` called with the input
and weight quantizers serving the op's edges (``get_attr`` of the two modules): ``s_b = s_in · s_w`` is read
through ``FakeQuantize.get_qparams()`` at every call, never observed. Quantizer names follow the tensor they
serve (``layer1.0.conv1.weight``); annotations are cleared.
"""

from __future__ import annotations

import re
from dataclasses import replace

from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.graph.capture_error import source_of
from coreai_opt.graph.graph_attrs import node_shape
from coreai_opt.graph.identity_ops import is_identity
from coreai_opt.graph.node_meta import (
    DerivedSpec,
    NodeMeta,
    QuantizerInfo,
    Role,
    copy_provenance,
    get_meta,
    node_label,
    set_meta,
    tensor_info,
)
from coreai_opt.graph.op_kinds import MOVER_KINDS, OpKind
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.quantizer_groups import QuantizerGroup, QuantizerPlan, plan_quantizers
from coreai_opt.quantization.spec import FAKE_QUANTIZE, BiasFakeQuantize, PerTensor

__all__ = ["insert_quantizers"]


def _serves(node: Node) -> str:
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


def _unique(serves: str, used: set[str], *, per_tail: bool = False) -> str:
    """Number a name already taken (a module called at several sites: ``relu.output``, ``relu[1].output``).

    Activations and weights count every numbered name of the stem, biases (``per_tail``) only ``stem[k].bias``.
    """
    if serves in used:
        stem, _, tail = serves.rpartition(".")
        k = sum(u.startswith(f"{stem}[") and (not per_tail or u.endswith(f"].{tail}")) for u in used) + 1
        serves = f"{stem}[{k}].{tail}"
    used.add(serves)
    return serves


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


def _mover_error(mover: Node, group: QuantizerGroup, shape: tuple[int, ...], exc: ValueError) -> CoreaiOptValueError:
    """The error of a per-channel / per-block activation spec that does not fit a requantized mover's output."""
    g = group.spec.spec.granularity
    where = source_of(mover) or "(no source line recorded)"
    reader = node_label(group.requester)
    return CoreaiOptValueError(
        f"the {g.type_name} activation spec (axis {g.axis}) asked by '{reader}' cannot quantize the output of the "
        f"value-moving op '{node_label(mover)}' ({mover.target}) at {where}: that op moves elements to other "
        f"channels, so its output {tuple(shape)} is requantized with a quantizer of its own, and {exc}. Fix: give "
        f"'{reader}' an activation spec laid out for {tuple(shape)} (an axis in [-{len(shape)}, {len(shape) - 1}], "
        "a block size dividing it) or PerTensor(), e.g. config.set_module_name(<its name>, "
        "OpConfig(activation=...)), or move the op after the layer so the channel axis stays in place"
    )


class _Inserter:
    """Builds the modules of one :class:`QuantizerPlan` and wires their calls into the graph."""

    def __init__(self, gm: GraphModule, plan: QuantizerPlan) -> None:
        self.gm, self.plan = gm, plan
        self.used: set[str] = set()
        self.modules: dict[int, tuple[str, QuantizerInfo]] = {}  # id(group) -> (module name, info)
        self.call_at: dict[Node, Node] = {}  # a source / exit -> the quantizer call its readers read
        self.float_of: dict[Node, Node] = {}  # that call -> the float node it quantizes
        self.float_copies: dict[Node, Node] = {}
        self.changes = 0

    def sources(self, members: list[Node]) -> list[Node]:
        return [n for n in members if n not in self.plan.followers]

    def build(self, group: QuantizerGroup) -> None:
        """Create the group's module (named after the tensor it serves) and call it on the group's outputs."""
        if group.outputs:
            sources = self.sources(group.outputs)
            if not sources:
                return
            first, serves = sources[0], _unique(_serves(sources[0]), self.used)
        else:
            producer, consumer = group.edges[0]
            tensor = self.sources(self.plan.tensor_members.get(producer, [producer])) or [producer]
            first, serves = tensor[0], _serves(tensor[0])
            if serves in self.used or self.has_module(self.plan.output_groups.get(producer)):
                serves = f"{serves}@{node_label(consumer)}"
            serves = _unique(serves, self.used)
        qspec = group.spec
        fq = FAKE_QUANTIZE.get_class(qspec.spec.fake_quantize).from_spec(qspec.spec)
        fq.set_name(serves)
        shape = node_shape(first if group.outputs else group.edges[0][0], self.gm)
        if shape is not None and (-1 not in shape or isinstance(qspec.spec.granularity, PerTensor)):
            try:
                fq.initialize(shape)
            except ValueError as exc:
                if get_meta(first).kind in MOVER_KINDS and qspec.role is Role.ACTIVATION:
                    raise _mover_error(first, group, shape, exc) from exc
                raise ValueError(f"quantizer for {serves} ({first.format_node()}): {exc}") from exc
        name = _attr_name(self.gm, serves, qspec.role)
        self.gm.add_submodule(name, fq)
        op_kind = get_meta(group.requester).kind if qspec.role is Role.WEIGHT else get_meta(first).kind
        info = QuantizerInfo(name, qspec.role, serves, op_kind or OpKind.OTHER)
        self.modules[id(group)] = (name, info)
        followers = self.plan.followers
        exits = [n for n in group.outputs if n in followers and tensor_info(n) is not None
                 and not is_identity(self.gm, n) and self.read_outside(n)]
        for source in (sources + exits) if group.outputs else []:
            call = _insert_call(self.gm, name, source, (source,), info, after=True, source=source)
            source.replace_all_uses_with(call, delete_user_cb=lambda user, call=call: user is not call)
            self.call_at[source], self.float_of[call] = call, source
            self.changes += 1

    def read_outside(self, node: Node) -> bool:
        """True when a node outside the group reads ``node``, directly or through identity members."""
        followers = self.plan.followers
        return any(u not in followers or (is_identity(self.gm, u) and self.read_outside(u)) for u in node.users)

    def has_module(self, group: QuantizerGroup | None) -> bool:
        """True when ``group`` quantizes node outputs (its module is called after its sources)."""
        return group is not None and bool(self.sources(group.outputs))

    def wire_edges(self, group: QuantizerGroup) -> None:
        """Call a split-off group's module on the float producer of each of its edges; only those edges read it."""
        if id(group) not in self.modules or not group.edges:
            return
        name, info = self.modules[id(group)]
        producers = list(dict.fromkeys(p for p, _ in group.edges))
        for producer in producers:
            float_value = self.float_version(producer)
            call = _insert_call(self.gm, name, float_value, (float_value,), info, after=True, source=producer)
            for p, consumer in group.edges:
                if p is producer:
                    consumer.replace_input_with(self.call_at.get(producer, producer), call)
            self.changes += 1

    def float_version(self, node: Node) -> Node:
        """``node`` computed from float values: a follower of a quantized group is replayed on float inputs."""
        node = self.float_of.get(node, node)
        if node not in self.plan.followers or not self.has_module(self.plan.output_groups.get(node)):
            return node
        if node not in self.float_copies:
            args = map_arg(node.args, self.float_version)
            kwargs = map_arg(node.kwargs, self.float_version)
            with self.gm.graph.inserting_after(node):
                copy = self.gm.graph.create_node(node.op, node.target, args, kwargs)
            copy.meta = dict(node.meta)
            self.float_copies[node] = copy
        return self.float_copies[node]

    def module_for(self, edge: tuple[Node, Node]) -> str | None:
        group = self.plan.edge_groups.get(edge)
        return self.modules[id(group)][0] if group is not None and id(group) in self.modules else None


def insert_quantizers(gm: GraphModule) -> PassResult:
    """Insert one quantizer per group of annotated points and the derived int32 bias quantizers.

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
    plan = plan_quantizers(nodes)
    inserter = _Inserter(gm, plan)
    for group in plan.groups:
        inserter.build(group)
    for group in plan.groups:
        inserter.wire_edges(group)
    for bias, op, derived in plan.biases:
        inserter.changes += _insert_bias(gm, bias, op, derived, inserter)
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.annotation is not None:
            set_meta(node, replace(meta, annotation=None))
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, inserter.changes)


def _insert_bias(gm: GraphModule, bias: Node, op: Node, derived: DerivedSpec, inserter: _Inserter) -> int:
    """Insert the int32 bias quantizer of ``op``; record a reason and return 0 when it cannot be derived.

    A module called at several sites gets one bias quantizer per call, numbered like the other quantizers
    (``l.bias``, ``l[1].bias``, ...).
    """
    names = [inserter.module_for((n, op)) for n in derived.derived_from]
    reason = None
    if None in names:
        reason = "bias left float: the input or weight quantizer was not created"
    else:
        in_fq, w_fq = (gm.get_submodule(n) for n in names)
        if not in_fq.stateful or not w_fq.stateful:
            reason = "bias left float: a dynamic (stateless) quantizer has no scale buffer to derive from"
        elif not isinstance(in_fq.spec.granularity, PerTensor) or in_fq.spec.dtype_info.is_float:
            reason = "bias left float: the input quantizer is not an integer per-tensor quantizer"
    if reason is not None:
        meta = get_meta(op)
        reason = f"{meta.module_name or op.name} {reason}"
        set_meta(op, replace(meta, float_reason=f"{meta.float_reason}; {reason}" if meta.float_reason else reason))
        return 0
    serves = _unique(str(bias.target), inserter.used, per_tail=True)
    name = _attr_name(gm, serves.removesuffix(".bias") if serves.endswith(".bias") else serves, Role.BIAS)
    bq = BiasFakeQuantize()
    bq.set_name(serves)
    gm.add_submodule(name, bq)
    with gm.graph.inserting_before(op):
        quantizers = [gm.graph.get_attr(n) for n in names]
    for q in quantizers:
        set_meta(q, NodeMeta(kind=OpKind.PARAMETER))
    info = QuantizerInfo(name, Role.BIAS, serves, get_meta(op).kind)
    call = _insert_call(gm, name, op, (bias, *quantizers), info, after=False, source=bias)
    op.replace_input_with(bias, call)
    return 1
