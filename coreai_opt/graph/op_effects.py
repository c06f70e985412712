"""What an FX node may do besides returning a value: write into a tensor, return an alias of an input, or neither.

Two questions are answered from tables of targets whose behaviour is known, and every target that is not in a
table gets the *conservative* answer:

* :func:`may_alias_input` -- may the node's output share storage with one of its tensor inputs (a view, or the
  very same tensor)? True for view ops (``view``, ``reshape``, ``transpose``, ``x[...]``, ``split``, ...), ops
  that may return their input unchanged (``contiguous``, ``to``, ``float``, ``nn.Identity``, ``Dropout``) and
  every unknown op or module; False only for ops known to allocate their result (``add``, ``conv2d``,
  ``nn.Linear``, ...). For aten ops the schema's alias annotations decide.
* :func:`is_pure` -- may the node be deleted when nothing reads it? Only for ops known to have no effect but
  their result: never a placeholder, the output, an in-place or ``out=`` op, a random op, a module with state
  (BatchNorm statistics, quantizer observers) or a module/function the tables do not know.

Both are used by :mod:`.functionalize_inplace` and :mod:`.dead_code`.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

__all__ = ["FRESH_METHODS", "VIEW_METHODS", "may_alias_input", "is_pure", "mutates", "sets_inplace"]

#: Tensor methods that always allocate their result (or return a non-tensor).
FRESH_METHODS: frozenset[str] = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow", "neg", "abs", "sign",
    "matmul", "mm", "bmm", "addmm", "baddbmm", "addcmul", "addcdiv", "lerp", "maximum", "minimum", "clamp", "clip",
    "relu", "sigmoid", "tanh", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "reciprocal", "square", "erf",
    "sin", "cos", "round", "floor", "ceil", "trunc", "frac", "softmax", "log_softmax", "mean", "sum", "prod",
    "std", "var", "norm", "amax", "amin", "max", "min", "argmax", "argmin", "cumsum", "cumprod", "topk", "sort",
    "masked_fill", "where", "clone", "repeat", "repeat_interleave", "index_select", "gather", "scatter",
    "scatter_add", "index_add", "index_fill", "index_copy", "masked_scatter", "masked_select", "nonzero", "tril",
    "triu", "flip", "roll", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "isnan", "isinf", "isfinite", "nan_to_num", "all", "any", "size", "dim", "numel", "nelement", "ndimension",
    "item", "tolist",
})

#: Tensor methods that return a view of (or possibly the same tensor as) their input.
VIEW_METHODS: frozenset[str] = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "squeeze", "unsqueeze", "expand",
    "expand_as", "flatten", "unflatten", "narrow", "select", "diagonal", "as_strided", "split", "chunk", "unbind",
    "tensor_split", "split_with_sizes", "detach", "contiguous", "movedim", "moveaxis", "swapaxes", "swapdims",
    "unfold", "real", "imag", "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long",
    "bool", "cpu", "cuda",
})

_FRESH_FUNCTIONS: frozenset[Any] = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.xor,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.cat, torch.concat, torch.stack,
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs, torch.neg,
    torch.clamp, torch.clip, torch.where, torch.mean, torch.sum, torch.amax, torch.amin, torch.softmax,
    torch.log_softmax, torch.maximum, torch.minimum, torch.erf, torch.pow, torch.square, torch.conv1d,
    torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
    torch.clone, torch.zeros_like, torch.ones_like, torch.full_like, torch.arange, torch.cumsum, torch.masked_fill,
    torch.layer_norm, torch.group_norm, torch.embedding, torch.topk, torch.sort, torch.argmax, torch.argmin,
    torch._C._nn.linear, torch.nn.functional.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
    F.conv_transpose2d, F.conv_transpose3d, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.embedding, F.softmax, F.log_softmax, F.scaled_dot_product_attention, F.interpolate, F.pad, F.normalize,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
    F.pixel_shuffle, F.one_hot,
    # activations: fresh unless called with inplace=True (then they are in-place ops, handled separately)
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.leaky_relu, F.elu, F.selu,
    F.celu, F.softplus, F.softsign, F.tanh, F.sigmoid, F.threshold, F.glu, F.prelu,
})

#: Functions that only read Python attributes / sizes (never a tensor result that could alias).
_QUERY_FUNCTIONS: frozenset[Any] = frozenset({getattr, len, torch.Tensor.size, torch.Tensor.dim})

#: Functions that return a view of an input.
_VIEW_FUNCTIONS: frozenset[Any] = frozenset({
    operator.getitem, torch.reshape, torch.flatten, torch.unflatten, torch.permute, torch.transpose, torch.squeeze,
    torch.unsqueeze, torch.split, torch.chunk, torch.unbind, torch.t, torch.narrow, torch.select, torch.movedim,
    torch.swapaxes, torch.diagonal, torch.detach, torch.tensor_split,
})

#: torch.nn module types whose forward allocates a fresh result and touches no state (exact types only).
_STATELESS_MODULES: tuple[type, ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
    nn.Bilinear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.ReLU, nn.ReLU6, nn.LeakyReLU,
    nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Threshold, nn.PReLU, nn.Softmax, nn.LogSoftmax,
    nn.Softmin, nn.GLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.LPPool1d, nn.LPPool2d, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
)
#: Also fresh, but with state a forward may update (running statistics in train mode): never deleted.
_STATEFUL_FRESH_MODULES: tuple[type, ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)


def _module(gm: GraphModule, node: Node) -> nn.Module | None:
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


@functools.lru_cache(maxsize=256)
def _inplace_position(target: Any) -> int | None:
    """Index of the ``inplace`` parameter of a Python function (``F.relu(x, inplace)``), None when it has none."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # builtins without a signature have no inplace flag
        return None
    return names.index("inplace") if "inplace" in names else None


def sets_inplace(node: Node) -> bool:
    """True for a ``call_function`` passing ``inplace=True`` (by keyword or position)."""
    if node.op != "call_function":
        return False
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is True
    try:
        index = _inplace_position(node.target)
    except TypeError:  # unhashable target
        return False
    return index is not None and index < len(node.args) and node.args[index] is True


def mutates(node: Node) -> bool:
    """Whether ``node`` calls an ATen or custom op whose schema writes into an argument (``add_``, ``copy_``)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _aten_aliases(target: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None for r in target._schema.returns)


def may_alias_input(gm: GraphModule, node: Node) -> bool:
    """True unless ``node``'s output is known to be freshly allocated (or not a tensor).

    Example:
        >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Flatten()))
        >>> [may_alias_input(gm, n) for n in gm.graph.nodes if n.op == "call_module"]
        [False, True]
    """
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    if node.op == "call_module":
        module = _module(gm, node)
        return module is None or type(module) not in (*_STATELESS_MODULES, *_STATEFUL_FRESH_MODULES) or getattr(
            module, "inplace", False) is True
    if node.op == "call_method":
        return str(node.target) not in FRESH_METHODS
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _aten_aliases(target)
    if target in _QUERY_FUNCTIONS:
        return False
    try:
        fresh = target in _FRESH_FUNCTIONS
    except TypeError:  # unhashable target
        return True
    return not fresh or sets_inplace(node) or "out" in node.kwargs


def is_pure(gm: GraphModule, node: Node) -> bool:
    """True when deleting ``node`` (once nothing reads it) cannot change what the model computes or stores.

    Example:
        >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        >>> [is_pure(gm, n) for n in gm.graph.nodes]
        [False, True, False, False]
    """
    if node.op in ("placeholder", "output"):
        return False
    if node.op == "get_attr":
        return True
    if node.op == "call_module":
        module = _module(gm, node)
        return (module is not None and type(module) in _STATELESS_MODULES
                and getattr(module, "inplace", False) is not True)
    if "out" in node.kwargs or sets_inplace(node):
        return False
    if node.op == "call_method":
        name = str(node.target)
        return name in FRESH_METHODS or name in VIEW_METHODS
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return not (schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags or node.is_impure())
    try:
        return target in _FRESH_FUNCTIONS or target in _VIEW_FUNCTIONS or target in _QUERY_FUNCTIONS
    except TypeError:
        return False
