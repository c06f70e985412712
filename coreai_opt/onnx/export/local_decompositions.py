"""Decompose only the nodes that need it, instead of re-tracing the whole exported program.

``torch.onnx.export(dynamo=True)`` captures the model (``torch.export``), then calls
``ExportedProgram.run_decompositions(table)`` with the ops torchlib cannot translate (``__and__``, ``to.dtype``,
``adaptive_avg_pool2d``, ...), then translates. ``run_decompositions`` traces the *whole* graph again under fake
tensors and symbolic shapes, about as long as the capture itself, though a quantized graph needs a handful of its
nodes decomposed (hf BERT: 11 of ~420; timm EfficientNet-B0: 1 of ~850). That second trace was the largest share
of ``export_onnx``'s time and grew with the quantizer nodes: under the profiler, timm-efficientnet-b0's
decompositions took 10.2 s of an 18 s export (the float export's, 4.8 s).

:func:`decompositions_local` replaces that step, for the duration of a ``with`` block, by a local one:

1. Collect the nodes ``run_decompositions`` would lower: an op the table decomposes (one torchlib has no
   translation for), or a ``CompositeImplicitAutograd`` op torch cannot preserve (a view or alias: ``reshape``,
   ``flatten``, ``to.dtype``), which it lowers whether torchlib translates it or not.
2. Trace each alone with ``make_fx(decomposition_table=table, tracing_mode="symbolic")`` on its inputs' fake
   values (the program's own fake mode and shape environment, so sizes stay the program's symbols).
3. Splice each traced subgraph in place of its node (inputs mapped, provenance metadata copied, the program's
   output signature renamed where a graph output was replaced).

It changes nothing and hands the program to torch's ``run_decompositions`` whenever the local route cannot be
sure to give the same program: a higher-order op (``cond``, a grad-mode wrapper), an op that mutates its input,
an op that neither torchlib translates nor the table decomposes, a subgraph that fails to trace, reads a constant,
gives several outputs the graph does not read by index, or holds an op torchlib cannot translate (a decomposition
written with in-place ops is traced again functionalized first).

What the file gets: onnxruntime's outputs bit-identical to torch's route, and on 38 of the 40 corpus models the
same graph node for node (op types, attributes, wiring, initializer contents; only value names differ,
``tests/onnx/test_local_decompositions.py``). Where they differ, it is in shape arithmetic: a restride that moves
no element is dropped (hf Swin, timm ConvNeXt-atto: 10 fewer nodes), or a size is read off another input of the
same size (hf GLM-4: 2 more ``Shape`` nodes of 515; timm NesT: 12 fewer of 875).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from coreai_opt.graph.op_effects import mutates

__all__ = ["decompositions_local", "decompose_locally"]

logger = logging.getLogger(__name__)

#: Checks torch's exporter removes after decomposition (``remove_assertion_nodes``); kept as they are.
_ASSERTIONS = frozenset({
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten.sym_constrain_range_for_size.default,
})
#: Node metadata a spliced node inherits from the node it replaces (where the op came from in the model).
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


class _NotLocal(Exception):
    """The program needs torch's whole-graph decomposition (the message says why)."""


def _lowered_by_torch(op: torch._ops.OpOverload) -> bool:
    """Whether ``run_decompositions`` lowers ``op`` whatever the table says.

    That is a ``CompositeImplicitAutograd`` op torch cannot preserve: a view or alias such as ``reshape``,
    ``flatten``, ``to.dtype``.
    """
    try:
        from torch._export.utils import _is_preservable_cia_op
    except ImportError as exc:  # a torch without this query: its own pass decides
        raise _NotLocal("torch cannot say which composite ops it preserves") from exc
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                                torch._C.DispatchKey.CompositeImplicitAutograd)
    return composite and not _is_preservable_cia_op(op)


def _to_decompose(graph: fx.Graph, translated: set[Any], table: dict[Any, Callable[..., Any]]) -> list[fx.Node]:
    """The nodes step 1 decomposes; raises :class:`_NotLocal` for a node the local route cannot handle."""
    nodes = []
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(graph.owning_module, str(node.target), None), fx.GraphModule):
            raise _NotLocal(f"subgraph {node.target}")
        if node.op != "call_function":
            continue
        op = node.target
        if isinstance(op, torch._ops.HigherOrderOperator):
            raise _NotLocal(f"higher-order op {op}")
        if not isinstance(op, torch._ops.OpOverload) or op in _ASSERTIONS:
            continue  # Python operators on sizes, checks the exporter drops
        if mutates(node):
            raise _NotLocal(f"mutating op {op}")
        if op in table or _lowered_by_torch(op):
            nodes.append(node)
        elif op not in translated:
            raise _NotLocal(f"{op} is neither translated nor decomposed")
    return nodes


def _traced(node: fx.Node, table: dict[Any, Callable[..., Any]], translated: set[Any], modes: set[int]
            ) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``node``'s op decomposed (step 2): the traced subgraph and the graph nodes its placeholders stand for.

    ``modes``: the fake modes of the program's values (:func:`_fake_modes`); the subgraph's must be among them.
    """
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    values = []
    for i in positions:
        if "val" not in flat[i].meta:
            raise _NotLocal(f"input {flat[i].name} of {node.name} has no traced value")
        values.append(flat[i].meta["val"])

    def call(*given: Any) -> Any:
        arguments = list(flat)
        for i, value in zip(positions, given, strict=True):
            arguments[i] = value
        args, kwargs = pytree.tree_unflatten(arguments, spec)
        return node.target(*args, **kwargs)

    sub = _make_fx(call, values, table, node)
    if any(mutates(inner) for inner in sub.graph.nodes):  # a decomposition written with in-place ops
        sub = _make_fx(torch.func.functionalize(call), values, table, node)
    if _fake_modes(sub.graph) - modes:
        # make_fx made a fake mode of its own (an op whose inputs hold no fake tensor of the program's): nodes
        # carrying its values break the exporter's later steps (hf Qwen3.5: "fake mode ... doesn't match mode")
        raise _NotLocal(f"{node.target} traces in a fake mode other than the program's")
    _drop_restrides(sub)
    outputs = sub.graph.output_node().args[0]
    if isinstance(outputs, (list, tuple)):  # meshgrid, split: the graph reads the parts with getitem
        if not all(isinstance(o, fx.Node) for o in outputs) or not all(
                u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users):
            raise _NotLocal(f"{node.target} decomposes to outputs the graph does not read by index")
    elif not isinstance(outputs, fx.Node):
        raise _NotLocal(f"{node.target} decomposes to {type(outputs).__name__}")
    for inner in sub.graph.nodes:
        if inner.op == "get_attr":
            raise _NotLocal(f"{node.target} decomposes to a constant")
        op = inner.target
        if inner.op == "call_function" and isinstance(op, torch._ops.OpOverload) and (
                mutates(inner) or op not in translated and op not in _ASSERTIONS):
            raise _NotLocal(f"{node.target} decomposes to {op}, which torchlib does not translate")
    readers = [node, *(u for u in node.users if u.target is operator.getitem)]
    if any(p.op == "placeholder" for p in pytree.tree_leaves(outputs)) and any(
            u.op == "output" for r in readers for u in r.users):
        raise _NotLocal(f"graph output {node.name} is an input once decomposed")
    return sub, [flat[i] for i in positions]


def _fake_modes(graph: fx.Graph) -> set[int]:
    """Identities of the fake modes of the fake tensors the nodes of ``graph`` carry as values."""
    return {id(v.fake_mode) for node in graph.nodes for v in pytree.tree_leaves(node.meta.get("val"))
            if isinstance(v, FakeTensor)}


def _make_fx(call: Callable[..., Any], values: list[Any], table: dict[Any, Callable[..., Any]], node: fx.Node
             ) -> fx.GraphModule:
    try:
        return make_fx(call, decomposition_table=table, tracing_mode="symbolic")(*values)
    except Exception as exc:  # noqa: BLE001 (any failure hands the program to torch's own decomposition)
        raise _NotLocal(f"{node.target} does not trace alone: {type(exc).__name__}") from exc


def _drop_restrides(sub: fx.GraphModule) -> None:
    """Remove ``as_strided_`` calls that leave every element of a tensor the subgraph made in its place.

    ``adaptive_avg_pool1d`` / ``2d`` to one output position decompose to ``mean`` then ``as_strided_(out,
    out.shape, strides)``, giving the fresh result the input's memory format. Where the shape is the same, there
    is no offset and the strides agree on every dimension of size other than 1, each element is read from the same
    place: the values do not change, and an ONNX tensor has no strides. (torch's whole-graph pass writes it as
    shape arithmetic and a ``Reshape`` to the same shape: hf Swin's file has 10 more nodes that way, with the same
    outputs.)
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    for inner in list(sub.graph.nodes):
        if inner.target is not torch.ops.aten.as_strided_.default or len(inner.args) > 3:
            continue
        source = inner.args[0]
        if not isinstance(source, fx.Node) or source.op == "placeholder" or len(source.users) != 1:
            continue
        size, stride = ([a.meta.get("val") if isinstance(a, fx.Node) else a for a in arg] for arg in inner.args[1:3])
        before = source.meta.get("val")
        if before is None or len(size) != before.dim() or len(stride) != before.dim():
            continue
        same_shape = all(statically_known_true(a == b) for a, b in zip(before.shape, size, strict=True))
        # every element keeps its place: the strides agree wherever the size is not 1
        same_places = all(statically_known_true(n == 1) or statically_known_true(a == b)
                          for n, a, b in zip(before.shape, before.stride(), stride, strict=True))
        if not (same_shape and same_places):
            continue
        inner.replace_all_uses_with(source)
        sub.graph.erase_node(inner)
    sub.graph.eliminate_dead_code()
    sub.recompile()


class _Sizes:
    """The graph's first node holding each symbolic size, and where it stands (to reuse it, as a re-trace does)."""

    def __init__(self, graph: fx.Graph, removed: set[fx.Node]) -> None:
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.first: dict[Any, fx.Node] = {}
        for n in graph.nodes:
            expr = _size_expr(n) if n not in removed else None
            if expr is not None:
                self.first.setdefault(expr, n)

    def earlier(self, expr: Any, before: fx.Node) -> fx.Node | None:
        known = self.first.get(expr)
        return known if known is not None and self.position[known] < self.position[before] else None


def _size_expr(node: fx.Node) -> Any:
    value = node.meta.get("val")
    return value.node.expr if isinstance(value, torch.SymInt) and value.node.expr.free_symbols else None


def _splice(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule, inputs: list[fx.Node],
            replaced: dict[fx.Node, fx.Node], sizes: _Sizes) -> None:
    """Step 3 for one node: ``sub`` in place of ``node``; ``replaced`` maps every removed node to its successor.

    A spliced ``sym_size`` whose symbolic value an earlier node of the graph already holds reads that node instead
    (torch's re-trace reuses the first holder of a size the same way; without it the file would measure the same
    size again with ``Shape`` nodes).
    """
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = {p: replaced.get(i, i) for p, i in zip(placeholders, inputs, strict=True)}
    anchor = node.prev
    with graph.inserting_before(node):
        output = graph.graph_copy(sub.graph, env)
    new = anchor.next
    while new is not node:  # the spliced nodes sit between the anchor and the node they replace
        following = new.next
        known = sizes.earlier(expr, node) if (expr := _size_expr(new)) is not None else None
        if known is not None and new.target is torch.ops.aten.sym_size.int:
            new.replace_all_uses_with(known)
            graph.erase_node(new)
        else:
            new.meta.update({key: node.meta[key] for key in _PROVENANCE if key in node.meta})
        new = following
    if isinstance(output, (list, tuple)):
        for part in list(node.users):  # getitem(node, i) -> output[i]
            part.replace_all_uses_with(output[part.args[1]])
            graph.erase_node(part)
            replaced[part] = output[part.args[1]]
    else:
        node.replace_all_uses_with(output)
        replaced[node] = output
    graph.erase_node(node)


def decompose_locally(program: torch.export.ExportedProgram, registry: Any,
                      whole_graph: Callable[[torch.export.ExportedProgram, Any], torch.export.ExportedProgram],
                      ) -> torch.export.ExportedProgram:
    """``program`` with the nodes torchlib cannot translate decomposed in place (module docstring).

    Args:
        program: The captured program (``torch.export``'s output).
        registry: torch's ``ONNXRegistry`` of the export (torchlib plus the custom translations).
        whole_graph: torch's own ``decompose_with_registry``, used when the local route does not apply.

    Returns:
        The same program object, decomposed, or ``whole_graph(program, registry)``.
    """
    try:  # the table torch's own pass builds (a torch without these helpers: its own pass)
        from torch.onnx._internal.exporter import _decomp

        translated = set(_decomp.get_onnx_implemented_overloads(registry))
        table = _decomp.create_onnx_friendly_decomposition_table(translated)
    except (ImportError, AttributeError):
        return whole_graph(program, registry)
    graph = program.graph_module.graph
    try:
        nodes = _to_decompose(graph, translated, table)
        modes = _fake_modes(graph)
        traced = [_traced(node, table, translated, modes) for node in nodes]
    except _NotLocal as reason:
        logger.info("torch's whole-graph decomposition: %s", reason)
        return whole_graph(program, registry)
    replaced: dict[fx.Node, fx.Node] = {}
    sizes = _Sizes(graph, {*nodes, *(u for n in nodes for u in n.users if u.target is operator.getitem)})
    for node, (sub, inputs) in zip(nodes, traced, strict=True):
        _splice(graph, node, sub, inputs, replaced, sizes)
    renamed = {node.name: output.name for node, output in replaced.items()}
    for spec in program.graph_signature.output_specs:  # the signature names the graph's outputs
        if getattr(spec.arg, "name", None) in renamed:
            spec.arg.name = renamed[spec.arg.name]
    graph.lint()
    program.graph_module.recompile()
    return program


@contextlib.contextmanager
def decompositions_local() -> Iterator[bool]:
    """Within the block, torch's exporter decomposes only the nodes that need it (:func:`decompose_locally`).

    Yields:
        True when torch's exporter has the step this replaces (else the block changes nothing).
    """
    try:
        from torch.onnx._internal.exporter import _fx_passes
    except ImportError:
        yield False
        return
    whole_graph = getattr(_fx_passes, "decompose_with_registry", None)
    if whole_graph is None:
        yield False
        return

    def local(program: torch.export.ExportedProgram, registry: Any) -> torch.export.ExportedProgram:
        return decompose_locally(program, registry, whole_graph)

    _fx_passes.decompose_with_registry = local
    try:
        yield True
    finally:
        _fx_passes.decompose_with_registry = whole_graph
