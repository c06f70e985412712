"""One table from op targets to an :class:`OpKind`, so that patterns are written once per kind.

A node is looked up by what it calls:

* ``call_module``: the module's type (walking its MRO, so subclasses of ``nn.Conv2d`` are convolutions);
* ``call_function``: the callable (``F.conv2d``, ``torch.add``, ``operator.add``) or, for aten ops, the
  overload packet (``aten.conv2d`` covers ``aten.conv2d.default`` and ``aten.conv2d.padding``);
* ``call_method``: the Tensor method name (``"reshape"``, ``"add"``).

``call_module(nn.Conv2d)``, ``F.conv2d`` and ``aten.conv2d.default`` all map to ``OpKind.CONV``. Each
function entry also says where the data input, the weight and the bias sit among the arguments
(``aten.embedding(weight, indices)`` and ``F.embedding(input, weight)`` differ), as an :class:`ArgLayout`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from coreai_opt.graph.attention_math import masked_softmax
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize

__all__ = ["OpKind", "ArgLayout", "OpEntry", "lookup_op", "MOVER_KINDS", "WEIGHTED_KINDS"]

aten = torch.ops.aten


class OpKind(str, Enum):
    """What an op does, as far as quantizer placement is concerned."""

    CONV = "conv"
    CONV_TRANSPOSE = "conv_transpose"
    LINEAR = "linear"
    MATMUL = "matmul"
    EMBEDDING = "embedding"
    ADD = "add"
    MUL = "mul"
    SUB = "sub"
    DIV = "div"
    CAT = "cat"
    LAYER_NORM = "layer_norm"
    GROUP_NORM = "group_norm"
    BATCH_NORM = "batch_norm"
    SOFTMAX = "softmax"
    GELU = "gelu"
    SILU = "silu"
    HARDSWISH = "hardswish"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    RELU = "relu"
    RELU6 = "relu6"
    HARDTANH = "hardtanh"
    INTERPOLATE = "interpolate"
    AVG_POOL = "avg_pool"
    MAX_POOL = "max_pool"
    MOVE = "move"
    DROPOUT = "dropout"
    QUANTIZE = "quantize"
    INPUT = "input"
    PARAMETER = "parameter"
    OUTPUT = "output"
    OTHER = "other"


#: Kinds whose output holds only values of their (first) input: they share its quantizer.
MOVER_KINDS: frozenset[OpKind] = frozenset({OpKind.MOVE, OpKind.DROPOUT, OpKind.MAX_POOL})
#: Kinds with a weight operand.
WEIGHTED_KINDS: frozenset[OpKind] = frozenset(
    {OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.LINEAR, OpKind.EMBEDDING}
)


@dataclass(frozen=True)
class ArgLayout:
    """Where an op's operands sit: ``(position, keyword)`` pairs, ``None`` when absent.

    Attributes:
        data: Positions of the tensor operands that carry activations (quantized as activations).
        weight: The weight operand of weighted ops.
        bias: The bias operand of weighted ops.
        weight_axes: ``(canonical axis, real axis)`` pairs when the call stores its weight other than the kind's
            usual layout, e.g. ``addmm(bias, x, W)`` with ``W`` ``[in, out]``: ``((0, 1), (1, 0))``.
    """

    data: tuple[tuple[int, str], ...] = ((0, "input"),)
    weight: tuple[int, str] | None = None
    bias: tuple[int, str] | None = None
    weight_axes: tuple[tuple[int, int], ...] | None = None

    @staticmethod
    def get(node: Node, ref: tuple[int, str] | None) -> Any:
        """Return the argument at ``ref`` (positional first, then keyword), or None."""
        if ref is None:
            return None
        index, name = ref
        if index < len(node.args):
            return node.args[index]
        return node.kwargs.get(name)


@dataclass(frozen=True)
class OpEntry:
    """One row of the table: the kind and the argument layout."""

    kind: OpKind
    layout: ArgLayout = ArgLayout()


_UNARY = ArgLayout()
_BINARY = ArgLayout(data=((0, "input"), (1, "other")))
_WEIGHTED = ArgLayout(weight=(1, "weight"), bias=(2, "bias"))
_F_EMBEDDING = ArgLayout(weight=(1, "weight"))
_ATEN_EMBEDDING = ArgLayout(data=((1, "indices"),), weight=(0, "weight"))
_CAT = ArgLayout(data=((0, "tensors"),))
# addmm(bias, x, W) = bias + x @ W with W [in, out] (GPT-2's Conv1D): a linear whose output channels are last.
_ADDMM = ArgLayout(data=((1, "mat1"),), weight=(2, "mat2"), bias=(0, "input"), weight_axes=((0, 1), (1, 0)))

# (kind, layout, call_module types, functions / aten packets, Tensor method names)
_ROWS: list[tuple[OpKind, ArgLayout, tuple[type, ...], tuple[Any, ...], tuple[str, ...]]] = [
    (OpKind.CONV, _WEIGHTED, (nn.Conv1d, nn.Conv2d, nn.Conv3d),
     (F.conv1d, F.conv2d, F.conv3d, aten.conv1d, aten.conv2d, aten.conv3d), ()),
    (OpKind.CONV_TRANSPOSE, _WEIGHTED, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
     (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
      aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d), ()),
    (OpKind.LINEAR, _WEIGHTED, (nn.Linear,), (F.linear, aten.linear), ()),
    (OpKind.LINEAR, _ADDMM, (), (torch.addmm, aten.addmm), ()),
    (OpKind.EMBEDDING, _F_EMBEDDING, (nn.Embedding,), (F.embedding,), ()),
    (OpKind.EMBEDDING, _ATEN_EMBEDDING, (), (aten.embedding,), ()),
    (OpKind.MATMUL, _BINARY, (), (torch.matmul, torch.bmm, torch.mm, operator.matmul,
                                  aten.matmul, aten.bmm, aten.mm), ("matmul", "bmm", "mm")),
    (OpKind.ADD, _BINARY, (), (torch.add, operator.add, operator.iadd, aten.add), ("add", "add_")),
    (OpKind.MUL, _BINARY, (), (torch.mul, operator.mul, operator.imul, aten.mul), ("mul", "mul_")),
    (OpKind.SUB, _BINARY, (), (torch.sub, operator.sub, operator.isub, aten.sub), ("sub", "sub_")),
    (OpKind.DIV, _BINARY, (), (torch.div, operator.truediv, operator.itruediv, aten.div), ("div", "div_")),
    (OpKind.CAT, _CAT, (), (torch.cat, torch.concat, aten.cat, aten.concat), ()),
    (OpKind.LAYER_NORM, _UNARY, (nn.LayerNorm,), (F.layer_norm, aten.layer_norm), ()),
    (OpKind.GROUP_NORM, _UNARY, (nn.GroupNorm,), (F.group_norm, aten.group_norm), ()),
    (OpKind.BATCH_NORM, _UNARY, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
     (F.batch_norm, aten.batch_norm, aten._native_batch_norm_legit_no_training), ()),
    (OpKind.SOFTMAX, _UNARY, (nn.Softmax,), (F.softmax, torch.softmax, aten.softmax, aten._softmax, masked_softmax),
     ("softmax",)),
    (OpKind.GELU, _UNARY, (nn.GELU,), (F.gelu, aten.gelu), ()),
    (OpKind.SILU, _UNARY, (nn.SiLU,), (F.silu, aten.silu), ()),
    (OpKind.HARDSWISH, _UNARY, (nn.Hardswish,), (F.hardswish, aten.hardswish), ()),
    (OpKind.SIGMOID, _UNARY, (nn.Sigmoid,), (torch.sigmoid, F.sigmoid, aten.sigmoid), ("sigmoid",)),
    (OpKind.TANH, _UNARY, (nn.Tanh,), (torch.tanh, F.tanh, aten.tanh), ("tanh",)),
    (OpKind.RELU, _UNARY, (nn.ReLU,), (F.relu, torch.relu, aten.relu, aten.relu_), ("relu", "relu_")),
    (OpKind.RELU6, _UNARY, (nn.ReLU6,), (F.relu6, aten.relu6), ()),
    (OpKind.HARDTANH, _UNARY, (nn.Hardtanh,), (F.hardtanh, aten.hardtanh, aten.hardtanh_), ()),
    (OpKind.INTERPOLATE, _UNARY, (nn.Upsample,),
     (F.interpolate, aten.upsample_nearest2d, aten.upsample_bilinear2d, aten.upsample_nearest1d,
      aten.upsample_linear1d), ()),
    (OpKind.AVG_POOL, _UNARY,
     (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
     (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
      F.adaptive_avg_pool3d, torch.mean, aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d,
      aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d, aten.mean), ("mean",)),
    (OpKind.MAX_POOL, _UNARY,
     (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
     (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
      aten.max_pool1d, aten.max_pool2d, aten.max_pool3d), ()),
    (OpKind.MOVE, _UNARY, (nn.Flatten, nn.Unflatten),
     (torch.reshape, torch.flatten, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze,
      torch.split, torch.tensor_split, torch.chunk, torch.unbind, torch.t, operator.getitem,
      aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.flatten,
      aten.unflatten, aten.squeeze, aten.unsqueeze, aten.contiguous, aten.clone, aten.split, aten.split_with_sizes,
      aten.chunk, aten.tensor_split, aten.unbind, aten.expand, aten.slice, aten.select, aten.alias),
     ("reshape", "view", "permute", "transpose", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous",
      "split", "tensor_split", "chunk", "unbind", "expand", "expand_as", "view_as", "reshape_as", "t", "clone")),
    (OpKind.DROPOUT, _UNARY, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity),
     (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, aten.dropout), ()),
]

_BY_MODULE: dict[type, OpEntry] = {}
_BY_FUNCTION: dict[Any, OpEntry] = {}
_BY_METHOD: dict[str, OpEntry] = {}
for _kind, _layout, _modules, _functions, _methods in _ROWS:
    _entry = OpEntry(_kind, _layout)
    for _m in _modules:
        # A module call passes only the activation; its parameters are attributes.
        _BY_MODULE[_m] = OpEntry(_kind, ArgLayout())
    for _f in _functions:
        _BY_FUNCTION[_f] = _entry
    for _name in _methods:
        _BY_METHOD[_name] = _entry

_OTHER = OpEntry(OpKind.OTHER, ArgLayout(data=()))
_MOVE = OpEntry(OpKind.MOVE, _UNARY)
#: Padding ops: a mover when they pad spatial axes with zeros (see :func:`_zero_spatial_pad`), else ``OTHER``.
_PADS: frozenset[Any] = frozenset({F.pad, aten.pad, aten.constant_pad_nd})


#: Casts: a mover when the output keeps its input's float dtype (see :func:`_same_dtype_cast`), else ``OTHER``.
_CASTS: frozenset[Any] = frozenset({aten.to, aten._to_copy, aten.type_as})
_CAST_METHODS = frozenset({"to", "type", "type_as", "float"})


def _same_dtype_cast(node: Node) -> bool:
    """True for a cast whose output has its input's floating dtype: it returns the values unchanged.

    transformers' eager attention writes ``softmax(scores, dtype=float32).to(query.dtype)``, a no-op in float32.
    As ``OTHER`` the cast's output got a quantizer of its own behind softmax's, calibrated on the same values
    (to ``[0, 1]``: a causal row of one position is exactly 1) while softmax's range is ``[0, 255/256]``; eager
    rounded twice and onnxruntime, after dropping the cast, merged the two Q/DQ pairs at softmax's scale (hf
    BLOOM, MPT, Gemma 2: verify's rule ``merged`` failed). A mover shares its input's quantizer instead.
    """
    source = node.args[0] if node.args else None
    if not isinstance(source, Node):
        return False
    out, value = (n.meta.get("val", n.meta.get("tensor_meta")) for n in (node, source))
    dtypes = getattr(out, "dtype", None), getattr(value, "dtype", None)
    return dtypes[0] is not None and dtypes[0] == dtypes[1] and dtypes[0].is_floating_point


def _zero_spatial_pad(node: Node) -> bool:
    """True for ``pad(x, pads, "constant", 0)`` that pads only axes 2.. of a tensor of known rank.

    Such a pad moves values without computing any: 0 is exactly on every activation grid (the qparams always
    include it), so ``pad(fq(x), 0) == fq(pad(x, 0))`` and the padded tensor can share its input's quantizer. A
    convolution's own zero padding is the same operation, which is what lets the exporter fold the pad into it.
    """
    def arg(index: int, name: str, default: Any) -> Any:
        return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)

    constant_pad_nd = getattr(node.target, "overloadpacket", node.target) is aten.constant_pad_nd
    mode = "constant" if constant_pad_nd else arg(2, "mode", "constant")
    value = arg(2, "value", 0) if constant_pad_nd else arg(3, "value", None)
    pads, source = arg(1, "pad", None), arg(0, "input", None)
    if mode != "constant" or value not in (None, 0, 0.0) or not isinstance(source, Node):
        return False
    if not isinstance(pads, (list, tuple)) or len(pads) % 2 or not all(isinstance(p, int) and p >= 0 for p in pads):
        return False
    example = source.meta.get("val", source.meta.get("tensor_meta"))
    rank = len(example.shape) if hasattr(example, "shape") else None
    return rank is not None and len(pads) // 2 <= rank - 2


def lookup_op(node: Node, gm: GraphModule) -> OpEntry:
    """Return the table row for ``node`` (``OpKind.OTHER`` when the target is not in the table).

    Example:
        >>> import torch.fx as fx
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU()))
        >>> [lookup_op(n, gm).kind.value for n in gm.graph.nodes]
        ['input', 'conv', 'relu', 'output']
    """
    if node.op == "placeholder":
        return OpEntry(OpKind.INPUT, ArgLayout(data=()))
    if node.op == "get_attr":
        return OpEntry(OpKind.PARAMETER, ArgLayout(data=()))
    if node.op == "output":
        return OpEntry(OpKind.OUTPUT, ArgLayout(data=((0, "result"),)))
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, (FakeQuantize, BiasFakeQuantize)):
            return OpEntry(OpKind.QUANTIZE, ArgLayout())
        for cls in type(module).__mro__:
            if cls in _BY_MODULE:
                return _BY_MODULE[cls]
        return _OTHER
    if node.op == "call_method":
        if str(node.target) in _CAST_METHODS:
            return _MOVE if _same_dtype_cast(node) else _OTHER
        return _BY_METHOD.get(str(node.target), _OTHER)
    target = node.target
    packet = getattr(target, "overloadpacket", None)  # aten OpOverload -> its packet
    if packet is not None:
        target = packet
    if target is aten.convolution:  # decomposed graphs: one op for both, told apart by `transposed`
        transposed = node.args[6] if len(node.args) > 6 else node.kwargs.get("transposed", False)
        return OpEntry(OpKind.CONV_TRANSPOSE if transposed else OpKind.CONV, _WEIGHTED)
    try:
        if target in _PADS:
            return _MOVE if _zero_spatial_pad(node) else _OTHER
        if target in _CASTS:
            return _MOVE if _same_dtype_cast(node) else _OTHER
        return _BY_FUNCTION.get(target, _OTHER)
    except TypeError:  # unhashable target
        return _OTHER
