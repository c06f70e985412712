r"""Rule: an RMSNorm written as elementwise ops -> onnxruntime's ``SimplifiedLayerNormalization``.

The exporter writes ``torch``'s RMSNorm (Llama, Qwen, Mistral, ...: ``w * x * rsqrt(mean(x²) + ε)``) as

    ``Pow(x, 2) -> ReduceMean(last axis, keepdims) -> Add(ε) -> Sqrt -> Reciprocal -> Mul(x, ·) -> Mul(w, ·)``

(or ``Div(x, Sqrt(...))`` for the reciprocal and its ``Mul``), seven kernels per norm. onnxruntime's optimizer
fuses the ``Div`` form into ``SimplifiedLayerNormalization``, not the ``Reciprocal`` one, and on the CPU provider it
never folds the residual ``Add`` in front of a norm into ``SkipSimplifiedLayerNormalization``, the kernel
onnxruntime-genai's builder writes. This rule writes, for

.. math:: y = w \odot \frac{x}{\sqrt{\tfrac{1}{D}\sum_{d} x_d^2 + \varepsilon}}

* ``SkipSimplifiedLayerNormalization(a, b, w, epsilon=ε)`` when ``x = a + b`` is a residual ``Add`` of two tensors
  of one recorded 3-D shape (a transformer's residual stream): its fourth output is the sum ``x`` (one float add,
  as before) for the rest of the stream;
* else ``Div(x, Sqrt(...))`` in place of ``Mul(x, Reciprocal(Sqrt(...)))``, which onnxruntime fuses into
  ``SimplifiedLayerNormalization`` (written directly, that default-domain op fails ``onnx.checker``).

The fused kernels accumulate the mean square in float in another order and divide instead of multiplying by a
reciprocal: the result differs from the elementwise graph's by rounding only (a few ulps; ``verify_onnx``'s kernel
table counts them as float-order kernels).

Sites: the pattern above with ``x`` float, ``w`` a 1-D constant of the last dimension's size, ``ε`` a constant
scalar, the exponent exactly 2, the mean over the last axis only, and every intermediate value read by the pattern
alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN, Fail, Match, Rule

__all__ = ["RmsNormsToSimplifiedLayerNorm"]


@dataclass(frozen=True)
class _Site(Match):
    x: str
    weight: str
    epsilon: float
    residual: onnx.NodeProto | None  # the Add producing x, folded in as the skip input
    normalise: onnx.NodeProto  # Mul(x, Reciprocal(root)) or Div(x, root)
    root: str  # the Sqrt output


def _plain(node: onnx.NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _scalar(graph: OnnxGraph, name: str) -> float | None:
    value = graph.constant(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _other(node: onnx.NodeProto, name: str) -> str:
    return node.input[1] if node.input[0] == name else node.input[0]


def _last_axis_mean(node: onnx.NodeProto, graph: OnnxGraph, rank: int | None) -> bool:
    attrs = attributes_of(node)
    if not int(attrs.get("keepdims", 1)):
        return False
    if "axes" in attrs:
        axes = [int(a) for a in attrs["axes"]]
    elif len(node.input) > 1 and node.input[1]:
        value = graph.constant(node.input[1])
        if value is None:
            return False
        axes = [int(a) for a in value.reshape(-1)]
    else:
        return False
    return axes == [-1] or (rank is not None and axes == [rank - 1])


def _residual(x: str, graph: OnnxGraph) -> onnx.NodeProto | None:
    """The ``Add`` of two tensors of one recorded 3-D shape producing ``x``, else None."""
    add = graph.producer(x)
    if not _plain(add, "Add") or len(add.input) != 2:
        return None
    shapes = [graph.shape(name) for name in add.input]
    if shapes[0] is None or len(shapes[0]) != 3 or shapes[0] != shapes[1] or x in graph.outputs:
        return None
    return add


class RmsNormsToSimplifiedLayerNorm(Rule):
    """``w · x · rsqrt(mean(x²) + ε)`` as elementwise ops -> ``SimplifiedLayerNormalization`` (module docstring)."""

    name = "rms_norms_to_simplified_layer_norm"
    anchors = frozenset({"Mul"})
    domains = {CONTRIB_DOMAIN: 1}

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """The weight ``Mul`` at the end of the pattern, walked back to ``x``."""
        if node.domain not in ("", "ai.onnx"):
            return None
        for weight, normed in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            scale = graph.constant(weight)
            inner = graph.producer(normed)
            if scale is None or scale.ndim != 1 or not (_plain(inner, "Mul") or _plain(inner, "Div")):
                continue
            site = self._normalised(inner, graph)
            if site is None:
                continue
            if isinstance(site, Fail):
                return site
            x, epsilon, chain = site
            residual = _residual(x, graph)
            if residual is None and inner.op_type == "Div":
                return None  # onnxruntime fuses this form itself
            if any(graph.only_reader(n.output[0]) is None for n in (inner, *chain)):
                return Fail("an intermediate value of the norm has another reader")
            shape = graph.shape(x)
            if shape is not None and shape[-1] != scale.shape[0]:
                return Fail(f"weight of {scale.shape[0]} elements for a last dimension of {shape[-1]}")
            if scale.dtype != np.float32:
                return Fail(f"weight is {scale.dtype}, not float32")
            root = next(n.output[0] for n in chain if n.op_type == "Sqrt")
            return _Site(node, x, weight, epsilon, residual, inner, root)
        return None

    @staticmethod
    def _normalised(inner: onnx.NodeProto, graph: OnnxGraph,
                    ) -> tuple[str, float, list[onnx.NodeProto]] | Fail | None:
        """``(x, ε, the Pow..Sqrt[..Reciprocal] nodes)`` when ``inner`` is ``x · 1/sqrt(...)`` or ``x / sqrt(...)``."""
        for x, root in ((inner.input[0], inner.input[1]), (inner.input[1], inner.input[0])):
            chain: list[onnx.NodeProto] = []
            node = graph.producer(root)
            if inner.op_type == "Mul":
                if not _plain(node, "Reciprocal"):
                    continue
                chain.append(node)
                node = graph.producer(node.input[0])
            elif root != inner.input[1]:
                continue
            if not _plain(node, "Sqrt"):
                continue
            add = graph.producer(node.input[0])
            if not _plain(add, "Add"):
                continue
            mean = next((p for p in map(graph.producer, add.input) if _plain(p, "ReduceMean")), None)
            if mean is None:
                continue
            epsilon = _scalar(graph, _other(add, mean.output[0]))
            power = graph.producer(mean.input[0])
            if epsilon is None or not _plain(power, "Pow") or power.input[0] != x:
                continue
            if _scalar(graph, power.input[1]) != 2.0:
                return Fail("the power is not 2")
            if not _last_axis_mean(mean, graph, graph.rank(x)):
                return Fail("the mean is not over the last axis alone with keepdims")
            return x, epsilon, [*chain, node, add, mean, power]
        return None

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """``SkipSimplifiedLayerNormalization`` in place of the ``Add`` (or ``Div`` for the reciprocal's ``Mul``)."""
        assert isinstance(match, _Site)
        node = match.node
        if match.residual is not None:
            add = match.residual
            norm = helper.make_node(
                "SkipSimplifiedLayerNormalization", [*add.input, match.weight], [node.output[0], "", "", match.x],
                name=graph.unique_node_name(f"{node.name or node.output[0]}_skip_simplified_layer_norm"),
                domain=CONTRIB_DOMAIN, epsilon=match.epsilon)
            graph.remove(node)
            graph.replace(add, [norm])
            return
        inner = match.normalise
        graph.replace(inner, [helper.make_node("Div", [match.x, match.root], list(inner.output),
                                               name=graph.unique_node_name(f"{inner.name or inner.output[0]}_div"))])
