r"""Ops that onnxruntime runs only in float, whatever quantizers surround them: they request no quantizers.

A quantizer pays off in onnxruntime when an integer kernel reads or writes its edge (``DQ → op → Q`` fuses into
``QLinearConv``, ``QLinearAdd``, ...). Around an op that has no integer kernel, a quantizer the op requests for
itself is a ``QuantizeLinear → DequantizeLinear`` round trip at run time and a rounding error, and nothing else:

* **an elementwise add / sub / mul / div with a number operand** (``x + eps``, ``x * 0.5``, ``logits / cap``):
  onnxruntime's ``QLinearAdd`` / ``QLinearMul`` need both operands quantized, and a Python number stays a float
  constant; there is no integer ``Div`` or ``Sub`` at all. The op is written ``DQ → Add(c) → Q``, three kernels.
* **a division by a tensor** (``x / x.norm(dim=-1, keepdim=True)``, Swin-V2's cosine attention): onnxruntime
  has no integer ``Div``, and a quantized divisor is worse than a round trip: a divisor whose values sit near zero
  next to large ones rounds to exactly 0 on the grid, and the quotient becomes ``inf`` (hf-swinv2: 67 % of one
  attention's codes non-finite in eager, top-1 agreement with float 44 %).
* **a mean that is not a spatial pool**: only the mean over the last two axes of a 4-D tensor becomes the integer
  ``QLinearGlobalAveragePool`` (:mod:`coreai_opt.onnx.rewrite.rules.means_to_global_average_pool`); an RMSNorm's
  ``x.pow(2).mean(-1)`` or a mean over the sequence stays a float reduction.
* **layer / group norm, GELU, SiLU, HardSwish and tanh** (:data:`NO_INTEGER_KERNEL`): onnxruntime fuses
  ``DQ → op → Q`` only for Conv, MatMul, Gemm, Add, Mul, the pools, LeakyRelu, Sigmoid, Softmax, Concat, Where and
  the value movers; these run in float whatever surrounds them. Unlike the rules above this one yields to the
  config: an ``op_kind`` / module entry that names the op keeps its quantizers (a user emulating another backend);
  only the global default gives way (:func:`yields_to_neighbours`).

Leaving such an op float removes only the quantizers nobody else asks for: an edge it shares with an integer
kernel (the producer's output, a consumer's input) is still quantized by that kernel's request, so a chain
``QLinearMatMul → x * c → QLinearMatMul`` keeps the same quantizers, while an RMSNorm's
``pow → mean → + eps → rsqrt`` loses three round trips per norm (issue 29: Gemma, Gemma2, Qwen3). A GELU or
LayerNorm between two linears keeps both edges (each linear asks for its side), while GPT-Neo's tanh GELU
``0.5 x (1 + tanh(c (x + 0.044715 x³)))``, whose tanh reads and feeds float arithmetic only, loses two round trips
per layer.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from coreai_opt.graph.node_meta import tensor_info
from coreai_opt.graph.op_kinds import OpKind

__all__ = ["NO_INTEGER_KERNEL", "float_only_reason", "yields_to_neighbours"]

#: Op kinds with quantization patterns that onnxruntime runs in float only (no ``QLinear*`` kernel, no Q / DQ
#: dropped around them): by default they request no quantizers of their own (module docstring).
NO_INTEGER_KERNEL: frozenset[OpKind] = frozenset(
    {OpKind.LAYER_NORM, OpKind.GROUP_NORM, OpKind.GELU, OpKind.SILU, OpKind.HARDSWISH, OpKind.TANH}
)
_ELEMENTWISE = frozenset({OpKind.ADD, OpKind.SUB, OpKind.MUL, OpKind.DIV})
_MEANS = frozenset({torch.mean, torch.ops.aten.mean, "mean"})


def _is_mean(node: Node) -> bool:
    target = getattr(node.target, "overloadpacket", node.target)
    try:
        return target in _MEANS
    except TypeError:  # unhashable target
        return False


def _spatial_mean(node: Node) -> bool:
    """``mean`` over exactly axes 2 and 3 of a 4-D tensor (what ``GlobalAveragePool`` computes)."""
    source = node.args[0] if node.args else node.kwargs.get("input")
    info = tensor_info(source) if isinstance(source, Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if info is None or len(info[0]) != 4 or dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return all(isinstance(d, int) for d in dims) and sorted(d % 4 for d in dims) == [2, 3]


def float_only_reason(node: Node, kind: OpKind, tensor_operands: int) -> str | None:
    """Why ``node`` runs only in float in onnxruntime (module docstring), or None when it may run on integers.

    Args:
        node: A classified node.
        kind: Its op kind.
        tensor_operands: How many of its activation operands are float tensors (the rest are numbers).

    Example:
        >>> import torch.fx as fx
        >>> gm = fx.symbolic_trace(lambda x: (x + 1e-6).mean(-1))
        >>> add, mean = list(gm.graph.nodes)[1:3]
        >>> float_only_reason(add, OpKind.ADD, 1)
        'add with a number operand (onnxruntime has no integer kernel for it)'
        >>> float_only_reason(mean, OpKind.AVG_POOL, 1)
        'mean over other axes than the spatial ones of a 4-D tensor (no integer kernel)'
    """
    if kind in _ELEMENTWISE and tensor_operands < 2:
        return f"{kind.value} with a number operand (onnxruntime has no integer kernel for it)"
    if kind is OpKind.DIV:
        return "division by a tensor (onnxruntime has no integer Div; a quantized divisor can round to 0)"
    if kind is OpKind.AVG_POOL and node.op in ("call_function", "call_method") and _is_mean(node) \
            and not _spatial_mean(node):
        return "mean over other axes than the spatial ones of a 4-D tensor (no integer kernel)"
    return None


def yields_to_neighbours(kind: OpKind, activation_source: str) -> str | None:
    """Why an op of ``kind`` requests no quantizers of its own, or None when it does.

    Args:
        kind: The op's kind.
        activation_source: The config entry its activation spec comes from (``"global"``, ``"op_kind:tanh"``,
            ``"module_name:..."``); only the global default gives way, an entry naming the op keeps its request.

    Example:
        >>> yields_to_neighbours(OpKind.TANH, "global")
        "tanh has no onnxruntime integer kernel (its edges are quantized only where a neighbour's kernel reads them)"
        >>> yields_to_neighbours(OpKind.TANH, "op_kind:tanh") is None
        True
    """
    if kind not in NO_INTEGER_KERNEL or activation_source != "global":
        return None
    return (f"{kind.value} has no onnxruntime integer kernel (its edges are quantized only where a neighbour's "
            "kernel reads them)")
