"""Rule: fold an explicit zero ``Pad`` in front of a quantized convolution into the convolution's own ``pads``.

TensorFlow-style "same" padding (Hugging Face's MobileNetV2 / EfficientNet / MobileViT, timm's ``Conv2dSame``)
pads explicitly, often asymmetrically (``[0, 1, 0, 1]``), before a convolution with ``padding=0``. The padded
tensor shares its input's quantizer (a zero pad is a mover: 0 is on every activation grid), so the exporter writes::

    DQ(q, s, z) -> Pad(0) -> Q(s, z) -> DQ(s, z) -> Conv(pads=p)

onnxruntime fuses neither the ``Pad`` nor the Q/DQ pair around it: every such layer runs a float ``Pad`` and a
requantization beside its ``QLinearConv`` (HF MobileNetV2: 52 of each, 1.84x the latency of ``quantize_static``,
whose float export already wrote the padding into the convolutions). The rewrite::

    DQ(q, s, z) -> Conv(pads = p + pad)                                 (the pad's input is dequantized with s, z)
    x -> Q(s, z) -> DQ(s, z) -> Conv(pads = p + pad)                    (otherwise: the pad moves behind Q / DQ)

Why it is exact: a convolution pads its input with 0, which is what the ``Pad`` wrote, and 0 is exactly on the
grid (``Q(0) = z``, ``DQ(z) = 0``), so ``Q(Pad(x, 0)) = Pad(Q(x), z)`` element for element; onnxruntime's
``QLinearConv`` pads with the input zero point. ``Q(DQ(q, s, z), s, z) = q`` for identical ``(s, z)`` and type,
so the first form also drops the requantization. Only ``constant`` pads of value 0 (absent or a zero constant)
with non-negative pads on the spatial axes (none on batch or channels, no ``axes`` input) in front of a ``Conv``
with explicit padding (``auto_pad`` unset) are folded; a per-tensor Q / DQ pair with constant qparams is required.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView
from coreai_opt.onnx.rewrite.rewrite_report import carry_metadata
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["FoldPadsIntoConvs"]


@dataclass(frozen=True)
class _Site(Match):
    pad: onnx.NodeProto
    quantize: onnx.NodeProto
    spatial_pads: tuple[int, ...]  # ONNX Conv order: every spatial begin, then every spatial end
    source: str  # the dequantized unpadded input (first form) or "" (second form: the Q reads the pad's input)


def _same_qparams(a: QdqView, b: QdqView) -> bool:
    """Same per-tensor scale, zero point and quantized type."""
    if a.quant_type != b.quant_type or a.granularity != "per_tensor" or b.granularity != "per_tensor":
        return False
    zero_a = np.zeros(1) if a.zero_point is None else a.zero_point.astype(np.float64).reshape(-1)
    zero_b = np.zeros(1) if b.zero_point is None else b.zero_point.astype(np.float64).reshape(-1)
    return bool(np.array_equal(a.scale.reshape(-1), b.scale.reshape(-1)) and np.array_equal(zero_a, zero_b))


def _zero_spatial_pads(pad: onnx.NodeProto, graph: OnnxGraph) -> tuple[int, ...] | str:
    """The Conv-order spatial pads of a zero ``constant`` Pad, or why it does not qualify."""
    if attributes_of(pad).get("mode", b"constant") not in (b"constant", "constant"):
        return "the pad is not constant-mode"
    if len(pad.input) > 3 and pad.input[3]:
        return "the pad names its axes"
    if len(pad.input) > 2 and pad.input[2]:
        value = graph.constant(pad.input[2])
        if value is None or np.any(value):
            return "the pad value is not a constant 0"
    pads = graph.constant(pad.input[1]) if len(pad.input) > 1 else None
    if pads is None or pads.size % 2 or pads.size < 6:
        return "the pads are not a constant of a rank >= 3 tensor"
    values = [int(v) for v in pads.reshape(-1)]
    rank = len(values) // 2
    begins, ends = values[:rank], values[rank:]
    if any(begins[:2]) or any(ends[:2]) or min(values) < 0:
        return "it pads the batch or channel axis, or crops"
    return (*begins[2:], *ends[2:])


class FoldPadsIntoConvs(Rule):
    """Fold a zero spatial ``Pad -> Q -> DQ`` in front of a ``Conv`` into its ``pads`` (module docstring)."""

    name = "fold_pads_into_convs"
    anchors = frozenset({"Conv"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``Conv`` whose input is ``DQ(Q(Pad(x)))``."""
        dequantize = QdqView.of(graph.producer(node.input[0]), graph)
        quantize = QdqView.of(graph.producer(dequantize.data), graph) if dequantize is not None else None
        pad = graph.producer(quantize.data) if quantize is not None else None
        if dequantize is None or quantize is None or quantize.is_dequantize or pad is None or pad.op_type != "Pad":
            return None
        if not (dequantize.has_constant_qparams and quantize.has_constant_qparams) \
                or not _same_qparams(quantize, dequantize):
            return Fail("the Q / DQ pair after the pad is not one per-tensor quantizer with constant qparams")
        spatial = _zero_spatial_pads(pad, graph)
        if isinstance(spatial, str):
            return Fail(spatial)
        attrs = attributes_of(node)
        auto_pad = attrs.get("auto_pad", b"NOTSET")
        if auto_pad not in (b"NOTSET", "NOTSET"):
            return Fail(f"the convolution pads itself (auto_pad={auto_pad!r})")
        source = QdqView.of(graph.producer(pad.input[0]), graph)
        if source is not None and source.is_dequantize and source.has_constant_qparams \
                and _same_qparams(source, quantize):
            return _Site(node, pad, quantize.node, spatial, source.node.output[0])
        exclusive = graph.readers(quantize.node.output[0]) == [dequantize.node] \
            and graph.readers(dequantize.node.output[0]) == [node] and graph.readers(pad.output[0]) == [quantize.node]
        if not exclusive or any(name in graph.outputs for name in (pad.output[0], dequantize.node.output[0])):
            return Fail("the padded tensor is read by more than this convolution")
        return _Site(node, pad, quantize.node, spatial, "")

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Add the pad to the convolution's ``pads``; read the unpadded tensor (what is left unused is removed)."""
        node = match.node
        attrs = attributes_of(node)
        spatial = len(match.spatial_pads) // 2
        pads = [int(p) for p in attrs.get("pads", [0] * (2 * spatial))]
        attrs["pads"] = [a + b for a, b in zip(pads, match.spatial_pads, strict=True)]
        inputs, absorbed = list(node.input), []
        if match.source:  # the pad's pair goes: the convolution computes its codes (it pads with the zero point)
            inputs[0], absorbed = match.source, [match.quantize]
        else:
            quantize = match.quantize
            moved = helper.make_node("QuantizeLinear", [match.pad.input[0], *quantize.input[1:]],
                                     list(quantize.output), name=quantize.name, **attributes_of(quantize))
            graph.replace(quantize, [carry_metadata(moved, quantize)])
            graph.forget_shapes({quantize.output[0], graph.readers(quantize.output[0])[0].output[0]})
        conv = helper.make_node("Conv", inputs, list(node.output), name=node.name, **attrs)
        graph.replace(node, [carry_metadata(conv, node, *absorbed)])
