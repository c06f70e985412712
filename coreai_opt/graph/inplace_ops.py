"""Recognise an FX node that writes into a tensor, and build its out-of-place form.

In-place forms recognised (both captures):

* ``call_method`` ``x.add_(y)``, ``x.clamp_(0)``, ``x.copy_(src)``, ... (any Tensor method ending in ``_``);
* ``call_function`` ``operator.iadd`` and friends on a tensor (FX records ``x += y`` that way, see
  :mod:`.capture`), ``torch.relu_(x)``, ``F.relu(x, inplace=True)`` (keyword or positional), any function
  called with an ``out=`` tensor, and aten overloads whose schema writes an argument (``aten.add_.Tensor``,
  ``aten.relu_.default``, ``aten.add.out``);
* ``call_module`` of a ``torch.nn`` module with ``inplace=True`` (``nn.ReLU(inplace=True)``, ``nn.Hardtanh``,
  ``nn.Dropout``, ...).

Out-of-place forms: the method / function / overload without the trailing ``_`` (``copy_`` -> ``aten.copy``,
``fill_`` -> ``aten.fill``), ``operator.add`` for ``operator.iadd``, ``inplace=False``, the call without ``out=``
followed by ``type_as(out)`` (``out=`` casts to the dtype of ``out``), and ``module.inplace = False``. Writes with
no value-preserving out-of-place form (``resize_``, ``set_``, random fills such as ``uniform_``) raise
:class:`NoOutOfPlaceForm`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.op_effects import sets_inplace

__all__ = ["InplaceWrite", "NoOutOfPlaceForm", "check_out_of_place", "inplace_write", "out_of_place",
           "plain_operator"]

aten = torch.ops.aten

_OPERATORS: dict[Any, Any] = {
    getattr(operator, f"i{name}"): getattr(operator, name if name not in ("and", "or") else f"{name}_")
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
                 "matmul")
}
#: In-place methods that change only the shape/strides of the tensor they are called on, not shared storage.
_METADATA_METHODS = frozenset({"t_", "transpose_", "squeeze_", "unsqueeze_", "swapaxes_", "swapdims_",
                               "as_strided_", "detach_"})
#: Methods ending in ``_`` that do not write values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
#: Writes without a value-preserving out-of-place form.
_NO_FORM = frozenset({"resize_", "resize_as_", "set_", "uniform_", "normal_", "bernoulli_", "random_",
                      "exponential_", "geometric_", "cauchy_", "log_normal_"})


class NoOutOfPlaceForm(ValueError):
    """An in-place op whose write cannot be expressed out of place."""


@dataclass(frozen=True)
class InplaceWrite:
    """``node`` writes into the tensor at argument ``where`` (an index into ``args`` or a keyword).

    Attributes:
        node: The in-place node.
        where: Position (int) or keyword (str) of the written argument.
        metadata_only: The op changes only shape/strides of that tensor (``t_``), so other views are unaffected.
    """

    node: Node
    where: int | str
    metadata_only: bool = False

    @property
    def target(self) -> Node:
        """The node whose tensor is written (read from the node now, so earlier rewrites are seen)."""
        value = self.node.args[self.where] if isinstance(self.where, int) else self.node.kwargs[self.where]
        assert isinstance(value, Node)
        return value


def _is_tensor(node: object) -> bool:
    """True when ``node`` is known to hold a tensor (a node without shape metadata counts as one)."""
    if not isinstance(node, Node):
        return False
    if "tensor_meta" in node.meta:
        return node.meta["tensor_meta"] is not None and hasattr(node.meta["tensor_meta"], "dtype")
    if "val" in node.meta:
        return isinstance(node.meta["val"], torch.Tensor)
    if isinstance(node.meta.get("type"), type):  # ShapeProp records the Python type of non-tensor results
        return issubclass(node.meta["type"], torch.Tensor)
    return True


def _written_arguments(target: torch._ops.OpOverload) -> list[tuple[int, str]]:
    return [(i, a.name) for i, a in enumerate(target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _aten_write(node: Node, target: torch._ops.OpOverload) -> InplaceWrite | None:
    written = _written_arguments(target)
    if not written:
        return None
    index, name = written[0]
    where: int | str = index if index < len(node.args) else name
    value = node.args[index] if index < len(node.args) else node.kwargs.get(name)
    metadata = target._schema.name.split("::")[-1] in _METADATA_METHODS
    return InplaceWrite(node, where, metadata) if _is_tensor(value) else None


def inplace_write(gm: GraphModule, node: Node) -> InplaceWrite | None:
    """Return what ``node`` writes into, or None when it writes nothing.

    Example:
        >>> class M(nn.Module):
        ...     def forward(self, x):
        ...         return x.mul_(2)
        >>> gm = torch.fx.symbolic_trace(M())
        >>> [inplace_write(gm, n) is not None for n in gm.graph.nodes]
        [False, True, False]
    """
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES and node.args:
            return InplaceWrite(node, 0, name in _METADATA_METHODS) if _is_tensor(node.args[0]) else None
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        torch_type = type(module).__module__.startswith("torch.nn.")
        return InplaceWrite(node, 0) if torch_type and getattr(module, "inplace", False) is True and node.args else None
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _aten_write(node, target)
    if isinstance(node.kwargs.get("out"), Node):
        return InplaceWrite(node, "out")
    if target in _OPERATORS or sets_inplace(node) or _torch_inplace_function(target) is not None:
        return InplaceWrite(node, 0) if node.args and _is_tensor(node.args[0]) else None
    return None


def plain_operator(node: Node) -> Any:
    """``operator.add`` for an ``operator.iadd`` node on a non-tensor (an int size), else None.

    FX generates ``a += b; iadd = a`` for such a node, which rebinds ``a`` for every later reader; on an immutable
    value the augmented operator means the plain one.
    """
    if node.op == "call_function" and node.target in _OPERATORS and node.args and not _is_tensor(node.args[0]):
        return _OPERATORS[node.target]
    return None


def _torch_inplace_function(target: Any) -> Any:
    """``torch.relu`` for ``torch.relu_`` (a torch function whose name ends in ``_``), else None."""
    name = getattr(target, "__name__", "")
    if not name.endswith("_") or name.startswith("_") or getattr(torch, name, None) is not target:
        return None
    return getattr(torch, name[:-1], None)


def _functional_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place overload of an in-place (``add_.Tensor``) or ``out=`` (``add.out``) aten overload."""
    packet_name = target._schema.name.split("::")[-1]
    overload = target._overloadname
    if packet_name.endswith("_"):
        packet = getattr(aten, packet_name[:-1], None)
        candidate = getattr(packet, overload, None) if packet is not None else None
        return candidate if candidate is not None and not candidate._schema.is_mutable else None
    names = [a.name for a in target._schema.arguments if not (a.alias_info and a.alias_info.is_write)]
    packet = getattr(aten, packet_name)
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if not candidate._schema.is_mutable and [a.name for a in candidate._schema.arguments] == names:
            return candidate
    return None


def _describe(node: Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"'{target}' (node {node.name})"


def _replacement(gm: GraphModule, write: InplaceWrite) -> tuple[str, Any, tuple[Any, ...], dict[str, Any]]:
    """``(op, target, args, kwargs)`` of the out-of-place call."""
    node = write.node
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        name = str(node.target)
        base = name[:-1]
        if name in _NO_FORM:
            raise NoOutOfPlaceForm(f"in-place op {_describe(node)} has no out-of-place form")
        if name == "copy_":
            return "call_function", aten.copy.default, args[:2], {}
        if hasattr(torch.Tensor, base):
            return "call_method", base, args, kwargs
        if hasattr(aten, base):
            return "call_function", getattr(aten, base), args, kwargs
        raise NoOutOfPlaceForm(f"in-place op {_describe(node)} has no out-of-place form")
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        functional = _functional_overload(target)
        if functional is None or len(_written_arguments(target)) != 1:
            raise NoOutOfPlaceForm(f"in-place op {_describe(node)} has no out-of-place aten overload")
        kwargs.pop("out", None)
        return "call_function", functional, args, kwargs
    if write.where == "out":
        kwargs.pop("out")
        return "call_function", target, args, kwargs
    if target in _OPERATORS:
        return "call_function", _OPERATORS[target], args, kwargs
    if sets_inplace(node):
        if "inplace" in kwargs:
            kwargs["inplace"] = False
        else:
            args = tuple(False if a is True and i > 0 else a for i, a in enumerate(args))
        return "call_function", target, args, kwargs
    return "call_function", _torch_inplace_function(target), args, kwargs


def check_out_of_place(gm: GraphModule, write: InplaceWrite) -> None:
    """Raise :class:`NoOutOfPlaceForm` when :func:`out_of_place` would; changes nothing."""
    if write.node.op != "call_module":
        _replacement(gm, write)


def out_of_place(gm: GraphModule, write: InplaceWrite) -> Node:
    """Insert the out-of-place form of ``write.node`` right before it and return the node holding the new value.

    The caller rewires readers and erases ``write.node``. For a module call the module's ``inplace`` flag is
    switched off and ``write.node`` itself is returned (it then computes the value out of place).

    Raises:
        NoOutOfPlaceForm: the write has no out-of-place form (the message names the node).
    """
    node = write.node
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        assert isinstance(module, nn.Module)
        module.inplace = False
        return node
    op, target, args, kwargs = _replacement(gm, write)
    graph = gm.graph
    with graph.inserting_before(node):
        new = graph.create_node(op, target, args, kwargs)
        if write.where == "out":  # out= casts the result to the dtype (and device) of ``out``
            new = graph.call_method("type_as", (new, node.kwargs["out"]))
    return new
