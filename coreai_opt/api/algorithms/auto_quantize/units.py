"""Find the decision units of a prepared model: layers grouped by the input tensor they read.

For every linear / convolution node owned by a module, a :class:`Layer` records the module name, the layer kind,
its multiply-accumulates per sample (batch 1: ``MACs = numel(output[1:]) · in_features`` for a linear,
``numel(output[1:]) · (C_in / groups) · k_h · k_w`` for a convolution, the first output dimension being the batch;
another dynamic size counts as 1) and the quantizer
modules it uses: the one on its input, the one on its weight and the ones on its output (after a fused
relu / relu6 / hardtanh). Layers whose input quantizer is the same module form one :class:`Unit`.
:func:`layer_int8_compute` finds the ``Int8ComputeActivation`` (the eager emulation of int8-compute
``MatMulNBits``) each linear reads its input through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from coreai_opt.graph.node_meta import example_shape, get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation

__all__ = ["Layer", "Unit", "find_units", "layer_int8_compute", "layer_quantizers"]

_LAYER_KINDS = {OpKind.LINEAR: "linear", OpKind.CONV: "conv"}
_FUSED = {OpKind.RELU, OpKind.RELU6, OpKind.HARDTANH}


@dataclass(frozen=True)
class Layer:
    """One linear or convolution.

    Attributes:
        name: Qualified module name.
        kind: ``"linear"`` or ``"conv"``.
        macs: Multiply-accumulates of one call on one sample (batch 1).
    """

    name: str
    kind: str
    macs: int


@dataclass(frozen=True)
class Unit:
    """Layers that read one input tensor and therefore take one candidate together.

    Attributes:
        layers: The layers, in graph order.
        kind: ``"linear"`` or ``"conv"`` (a unit mixing both is ``"conv"``: only formats both allow apply).
    """

    layers: tuple[Layer, ...]
    kind: str

    @property
    def names(self) -> tuple[str, ...]:
        """Module names of the layers."""
        return tuple(layer.name for layer in self.layers)

    @property
    def label(self) -> str:
        """The names joined by ``", "``."""
        return ", ".join(self.names)


def _quantizer(node: object) -> str | None:
    if isinstance(node, fx.Node) and node.op == "call_module" and get_meta(node).kind is OpKind.QUANTIZE:
        return str(node.target)
    return None


def _weight_shape(gm: fx.GraphModule, node: object) -> tuple[int, ...] | None:
    while isinstance(node, fx.Node) and node.op == "call_module":
        node = node.args[0] if node.args else None
    if isinstance(node, fx.Node) and node.op == "get_attr":
        owner, _, attr = str(node.target).rpartition(".")
        return tuple(getattr(gm.get_submodule(owner) if owner else gm, attr).shape)
    return None


def _macs(gm: fx.GraphModule, node: fx.Node, kind: str) -> int:
    shape, weight = example_shape(node), _weight_shape(gm, node.args[1] if len(node.args) > 1 else None)
    if shape is None or weight is None:
        return 0
    out = math.prod(max(1, d) for d in shape[1:])  # per sample at the example's sizes: dim 0 is the batch
    return out * (weight[1] if kind == "linear" else math.prod(weight[1:]))


def _output_quantizers(node: fx.Node) -> list[str]:
    users = list(node.users)
    if len(users) == 1 and get_meta(users[0]).kind in _FUSED:
        users = list(users[0].users)
    return [q for q in (_quantizer(u) for u in users) if q is not None]


def _layer_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    out = []
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.kind in _LAYER_KINDS and meta.module_name:
            out.append((node, _LAYER_KINDS[meta.kind]))
    return out


def layer_quantizers(gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Module name of every linear / conv -> the quantizer modules it uses (input, weight, output; no repeats)."""
    found: dict[str, list[str]] = {}
    for node, _ in _layer_nodes(gm):
        names = found.setdefault(get_meta(node).module_name, [])
        for q in [_quantizer(node.args[0]) if node.args else None,
                  _quantizer(node.args[1]) if len(node.args) > 1 else None, *_output_quantizers(node)]:
            if q is not None and q not in names:
                names.append(q)
    return {name: tuple(qs) for name, qs in found.items()}


def layer_int8_compute(gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Module name of every linear reading its input through an ``Int8ComputeActivation`` -> those modules."""
    found: dict[str, list[str]] = {}
    for node, _ in _layer_nodes(gm):
        x = node.args[0] if node.args else None
        if isinstance(x, fx.Node) and x.op == "call_module" and isinstance(gm.get_submodule(str(x.target)),
                                                                             Int8ComputeActivation):
            names = found.setdefault(get_meta(node).module_name, [])
            if str(x.target) not in names:
                names.append(str(x.target))
    return {name: tuple(targets) for name, targets in found.items()}


def find_units(gm: fx.GraphModule) -> list[Unit]:
    """Group the model's linears and convolutions by their input quantizer (graph order of first appearance).

    A layer without an input quantizer (its input is not a float tensor) is a unit of its own; a module called at
    several sites is one layer with the sum of the sites' MACs.
    """
    layers: dict[str, Layer] = {}
    group_of: dict[str, str] = {}
    for node, kind in _layer_nodes(gm):
        name = get_meta(node).module_name
        macs = _macs(gm, node, kind)
        previous = layers.get(name)
        if previous is not None:
            kind, macs = previous.kind, macs + previous.macs
        layers[name] = Layer(name, kind, macs)
        group_of.setdefault(name, _quantizer(node.args[0] if node.args else None) or f"<own>{name}")
    groups: dict[str, list[Layer]] = {}
    for name, layer in layers.items():
        groups.setdefault(group_of[name], []).append(layer)
    return [Unit(tuple(members), "conv" if any(m.kind == "conv" for m in members) else "linear")
            for members in groups.values()]
