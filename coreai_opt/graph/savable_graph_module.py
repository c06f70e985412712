"""A GraphModule that ``pickle`` / ``torch.save`` / ``copy.deepcopy`` reproduce exactly, node metadata included.

``torch.fx.GraphModule`` pickles its generated Python code and re-traces it on load. For coreai_opt's graphs
that fails or loses information: the re-trace instantiates the graph's tracer class without arguments (so a
custom tracer, or torch.export's ``_ModuleStackTracer``, raises ``TypeError``), a string type annotation
(``from __future__ import annotations``) breaks the import block, ``gm.meta`` is dropped, and every
``node.meta`` entry -- the ``NodeMeta`` that ``summary``, ``convert`` and ``export_onnx`` read -- is gone.

:class:`SavableGraphModule` pickles the graph itself instead: one record per node (op, name, target, args,
kwargs, type and the picklable part of its metadata), rebuilt on load with the public ``Graph.create_node`` in
the same order and under the same names, then recompiled. What is kept of ``node.meta``: the coreai_opt
``NodeMeta`` (a ``module_type`` that cannot be pickled by reference, e.g. a class defined inside a function,
becomes None), ``stack_trace``, ``nn_module_stack`` when it pickles, and the shape and dtype of each tensor
(``tensor_meta``; for exported graphs made from ``val`` with symbolic sizes as -1, the convention of
:func:`~coreai_opt.graph.node_meta.tensor_info`). Aten operators and memory formats, which pickle cannot store
(the latter only at protocol 2, ``torch.save``'s), are stored by name.

Loading a file runs no code from it beyond what ``pickle`` does for any module, so ``torch.load`` needs
``weights_only=False``: load only files you trust.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import TensorMetadata

from coreai_opt.graph.node_meta import META_KEY, stored_meta

__all__ = ["SavableGraphModule"]

_KEPT_META = ("stack_trace", "nn_module_stack")


@dataclass(frozen=True)
class _Ref:
    """A reference to an earlier node, by name."""

    name: str


@dataclass(frozen=True)
class _Operator:
    """An aten (or other torch.ops) overload or packet, by qualified name."""

    namespace: str
    name: str
    overload: str | None

    def resolve(self) -> Any:
        packet = getattr(getattr(torch.ops, self.namespace), self.name)
        return packet if self.overload is None else getattr(packet, self.overload)


@dataclass(frozen=True)
class _MemoryFormat:
    """A ``torch.memory_format`` (which pickle protocol 2, ``torch.save``'s default, cannot store), by name."""

    name: str


@dataclass(frozen=True)
class _NodeRecord:
    """One node as pickle stores it: targets, arguments and meta rewritten into picklable records."""

    name: str
    op: str
    target: Any
    args: Any
    kwargs: Any
    type: Any
    meta: dict[str, Any]


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=2)  # torch.save's protocol
    except Exception:  # noqa: BLE001 - any failure means "cannot be stored"
        return False
    return True


def _encode_target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target._schema.name.split("::")
        return _Operator(namespace, name, target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::")
        return _Operator(namespace, name, None)
    return target


def _encode_value(value: Any) -> Any:
    def leaf(v: Any) -> Any:
        if isinstance(v, fx.Node):
            return _Ref(v.name)
        return _MemoryFormat(str(v).removeprefix("torch.")) if isinstance(v, torch.memory_format) else v

    return map_aggregate(value, leaf)


def _decode_value(value: Any, nodes: dict[str, fx.Node]) -> Any:
    def leaf(v: Any) -> Any:
        if isinstance(v, _Ref):
            return nodes[v.name]
        return getattr(torch, v.name) if isinstance(v, _MemoryFormat) else v

    return map_aggregate(value, leaf)


def _node_meta(meta: Any, node: fx.Node) -> Any:
    """The coreai_opt NodeMeta with fields that cannot be pickled by reference (local classes) set to None."""
    if not dataclasses.is_dataclass(meta) or _picklable(meta):
        return meta
    changes = {f.name: None for f in dataclasses.fields(meta)
               if isinstance(getattr(meta, f.name), type) and not _picklable(getattr(meta, f.name))}
    cleaned = dataclasses.replace(meta, **changes)
    if not _picklable(cleaned):
        raise TypeError(f"the coreai_opt metadata of node {node.name!r} cannot be pickled: {cleaned!r}")
    return cleaned


def _shape_of(value: Any) -> Any:
    """A picklable ``tensor_meta`` from ShapeProp's (minus memory format) or from ``val`` (symbolic sizes -1)."""
    if isinstance(value, TensorMetadata):
        return value._replace(memory_format=None)
    if not isinstance(value, torch.Tensor):
        return None
    shape = torch.Size(int(s) if isinstance(s, int) else -1 for s in value.shape)
    return TensorMetadata(shape, value.dtype, value.requires_grad, (), None, False, {})


def _record(node: fx.Node) -> _NodeRecord:
    meta: dict[str, Any] = {}
    if META_KEY in node.meta:
        meta[META_KEY] = _node_meta(stored_meta(node), node)
    for key in _KEPT_META:
        if key in node.meta and _picklable(node.meta[key]):
            meta[key] = node.meta[key]
    shape = _shape_of(node.meta.get("tensor_meta", node.meta.get("val")))
    if shape is not None and _picklable(shape):
        meta["tensor_meta"] = shape
    kind = node.type if node.type is None or _picklable(node.type) else None
    return _NodeRecord(node.name, node.op, _encode_target(node.target), _encode_value(node.args),
                       _encode_value(node.kwargs), kind, meta)


def _graph(records: list[_NodeRecord], codegen: Any, tracer_cls: Any, tracer_extras: Any) -> fx.Graph:
    graph = fx.Graph(tracer_cls=tracer_cls, tracer_extras=tracer_extras)
    nodes: dict[str, fx.Node] = {}
    for record in records:
        target = record.target.resolve() if isinstance(record.target, _Operator) else record.target
        node = graph.create_node(record.op, target, _decode_value(record.args, nodes),
                                 _decode_value(record.kwargs, nodes), name=record.name, type_expr=record.type)
        node.meta.update(record.meta)
        nodes[record.name] = node
    graph._codegen = codegen
    return graph


def _rebuild(class_name: str, state: dict[str, Any], records: list[_NodeRecord], codegen: Any) -> SavableGraphModule:
    gm = SavableGraphModule.__new__(SavableGraphModule)
    gm.__dict__.update(state)
    type(gm).__name__ = class_name
    gm.graph = _graph(records, codegen, state.get("_tracer_cls"), state.get("_tracer_extras"))  # recompiles
    return gm


class SavableGraphModule(fx.GraphModule):
    """``fx.GraphModule`` whose pickled form is its graph (see the module docstring), not its generated code.

    Example:
        >>> import pickle
        >>> gm = SavableGraphModule(torch.nn.Sequential(torch.nn.ReLU()), fx.symbolic_trace(
        ...     torch.nn.Sequential(torch.nn.ReLU())).graph)
        >>> next(iter(gm.graph.nodes)).meta["coreai_opt"] = "kept"
        >>> loaded = pickle.loads(pickle.dumps(gm))
        >>> [n.name for n in loaded.graph.nodes], next(iter(loaded.graph.nodes)).meta["coreai_opt"]
        (['input_1', '_0', 'output'], 'kept')
    """

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__dict__.copy()
        del state["_graph"]
        records = [_record(node) for node in self.graph.nodes]
        return (_rebuild, (type(self).__name__, state, records, self.graph._codegen))
