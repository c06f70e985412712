"""What the passes decide about each node, stored as one frozen dataclass in ``node.meta["coreai_opt"]``.

Values are frozen so that ``Graph.node_copy``'s shallow meta copy is safe; passes *replace* a node's
:class:`NodeMeta` (``set_meta(node, dataclasses.replace(get_meta(node), ...))``) and never mutate it.

Quantizers are owned per *point*: an edge ``(producer, consumer)`` or a node (the node's output tensor).
A point's request is one of three spec kinds:

* :class:`QuantSpec`: this point asks for a quantizer built from a ``QuantizationSpec``;
* :class:`SharedSpec`: this point uses the quantizer of another point (value-preserving ops, ``cat``);
* :class:`DerivedSpec`: an int32 bias whose scale is derived, ``s_b = s_in · s_w``, zero point 0.

Which points share one quantizer is decided by union-find over the points
(:mod:`coreai_opt.graph.quantizer_groups`).

Annotations reference live ``Node`` objects and are consumed by ``insert_quantizers``, which clears them;
after insertion only names and :class:`QuantizerInfo` remain, so deep copies never see stale nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.fx import GraphModule, Node

from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = [
    "always_empty",
    "called_quantizer",
    "META_KEY",
    "Role",
    "QuantSpec",
    "SharedSpec",
    "DerivedSpec",
    "EdgeSpec",
    "Annotation",
    "QuantizerInfo",
    "NodeMeta",
    "get_meta",
    "set_meta",
    "stored_meta",
    "tensor_info",
    "example_shape",
    "copy_provenance",
    "node_label",
]

#: The key of every coreai_opt decision in ``node.meta`` and ``gm.meta``.
META_KEY = "coreai_opt"


class Role(str, Enum):
    """What a quantizer quantizes."""

    WEIGHT = "weight"
    ACTIVATION = "activation"
    BIAS = "bias"


@dataclass(frozen=True)
class QuantSpec:
    """The point (output or edge) asks for a quantizer built from ``spec``; ``role`` says what it quantizes.

    ``edge_only``: only the requesting edge reads the quantizer (a dynamic quantizer quantizes one consumer's
    input); by default an edge request on a tensor that has no other spec becomes the tensor's quantizer, which
    every reader without a request of its own reads too.

    ``refines``: the configured spec this one specialises (softmax's output: the activation spec with its range
    fixed to [0, 1]); a reader asking for the configured spec shares this quantizer.
    """

    spec: QuantizationSpec
    role: Role
    edge_only: bool = False
    refines: QuantizationSpec | None = None

    def satisfies(self, request: QuantSpec) -> bool:
        """True when a quantizer built for this request also satisfies ``request`` (same or refined spec)."""
        return request.spec == self.spec or (self.refines is not None and request.spec == self.refines)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, QuantizationSpec):
            raise TypeError(f"QuantSpec.spec must be a QuantizationSpec, got {type(self.spec).__name__}")


@dataclass(frozen=True)
class SharedSpec:
    """The tensor reuses the quantizer of ``edge_or_node`` (a node = its output tensor)."""

    edge_or_node: Node | tuple[Node, Node]

    def __post_init__(self) -> None:
        if not isinstance(self.edge_or_node, (Node, tuple)):
            raise TypeError(f"SharedSpec needs a Node or a (producer, consumer) edge, got {self.edge_or_node!r}")


@dataclass(frozen=True)
class DerivedSpec:
    """An int32 bias with ``scale = s_in · s_w`` taken from the quantizers of ``(input, weight)``."""

    derived_from: tuple[Node, Node]

    def __post_init__(self) -> None:
        if len(self.derived_from) != 2 or not all(isinstance(n, Node) for n in self.derived_from):
            raise TypeError(f"DerivedSpec.derived_from must be an (input, weight) node pair, got {self.derived_from!r}")


EdgeSpec = QuantSpec | SharedSpec | DerivedSpec


@dataclass(frozen=True)
class Annotation:
    """Quantizers an op asks for.

    Attributes:
        inputs: ``(argument node, spec)`` pairs, one per quantized input edge ``(argument node, this node)``.
        output: Spec of this node's output tensor, or None when the op leaves it to its consumers.
    """

    inputs: tuple[tuple[Node, EdgeSpec], ...] = ()
    output: EdgeSpec | None = None


@dataclass(frozen=True)
class QuantizerInfo:
    """Marks a node that calls a quantizer.

    Attributes:
        module: Target of the quantizer submodule.
        role: What it quantizes.
        serves: Readable name of the tensor, e.g. ``"layer1.0.conv1.weight"`` or ``"relu_3.output"``.
        op_kind: Kind of the op whose tensor it quantizes.
    """

    module: str
    role: Role
    serves: str
    op_kind: OpKind


@dataclass(frozen=True)
class NodeMeta:
    """Everything coreai_opt records on one node.

    Attributes:
        kind: Op kind from :mod:`coreai_opt.graph.op_kinds` (None before ``classify_ops``).
        module_name: Qualified name of the module that owns the op (None at top level).
        module_type: Type of that module.
        annotation: Requested quantizers (only between ``annotate`` and ``insert_quantizers``).
        float_reason: Why the op's output (or weight) stays float, shown by ``summary``.
        quantizer: Set on the nodes that call a quantizer.
    """

    kind: OpKind | None = None
    module_name: str | None = None
    module_type: type | None = None
    annotation: Annotation | None = None
    float_reason: str | None = None
    quantizer: QuantizerInfo | None = None


def called_quantizer(gm: GraphModule, node: Node, role: Role) -> FakeQuantize | None:
    """The ``FakeQuantize`` module ``node`` calls as a quantizer of ``role``, else None."""
    info = get_meta(node).quantizer
    if node.op != "call_module" or info is None or info.role is not role:
        return None
    module = gm.get_submodule(str(node.target))
    return module if isinstance(module, FakeQuantize) else None


def get_meta(node: Node) -> NodeMeta:
    """Return the node's :class:`NodeMeta` (an empty one when the node has none)."""
    value = node.meta.get(META_KEY)
    return value if isinstance(value, NodeMeta) else NodeMeta()


def stored_meta(node: Node) -> Any:
    """Whatever the node's coreai_opt slot holds (None when empty), for code that copies it verbatim (pickling)."""
    return node.meta.get(META_KEY)


def set_meta(node: Node, value: NodeMeta) -> None:
    """Replace the node's :class:`NodeMeta`."""
    node.meta[META_KEY] = value


def node_label(node: Node) -> str:
    """A readable name of the op a node runs: ``"b"`` (a torch.nn module), ``"blocks.0.attn.matmul"``, ``"add_1"``."""
    if node.op == "output":
        return "output"
    meta = get_meta(node)
    if meta.module_name and meta.module_type is not None and meta.module_type.__module__.startswith("torch.nn"):
        return meta.module_name
    return f"{meta.module_name}.{node.name}" if meta.module_name else node.name


def always_empty(node: Node) -> bool:
    """A tensor with a dimension of literal size 0 in its traced shape (``x.new_zeros(b, s, 0, d)``, an empty cache).

    It is empty for every input (a symbolic size is never 0 here: ``torch.export`` specializes sizes 0 and 1), so it
    holds no value a quantizer could observe or round.
    """
    info = tensor_info(node)
    return info is not None and 0 in info[0]


def tensor_info(node: Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Return ``(shape, dtype)`` of a node's output when it is a single tensor, else None.

    Reads ``meta["val"]`` (torch.export) or ``meta["tensor_meta"]`` (ShapeProp after FX tracing). Symbolic
    sizes (dynamic batch) are reported as -1.
    """
    val: Any = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = tuple(int(s) if isinstance(s, int) else -1 for s in val.shape)
        return shape, val.dtype
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "dtype") and hasattr(tm, "shape"):
        return tuple(int(s) if isinstance(s, int) else -1 for s in tm.shape), tm.dtype
    return None


def _example_size(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)  # a backed symbol keeps the example's size
    return int(hint) if isinstance(hint, int) else -1


def example_shape(node: Node) -> tuple[int, ...] | None:
    """The shape a node's output had for the capture's example inputs, else None (not a single tensor).

    Unlike :func:`tensor_info`, a symbolic size (a dynamic batch or sequence axis of a torch.export capture) is
    reported as the example's size, e.g. to count the MACs of one calibration sample; -1 only when torch kept no
    example value.
    """
    val: Any = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(_example_size(s) for s in val.shape)
    info = tensor_info(node)
    return None if info is None else info[0]


def copy_provenance(src: Node, dst: Node) -> None:
    """Copy ``stack_trace`` and ``nn_module_stack`` (when present) from the node a new node serves."""
    if src.stack_trace is not None:
        dst.stack_trace = src.stack_trace
    for key in ("nn_module_stack", "tensor_meta", "val"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
