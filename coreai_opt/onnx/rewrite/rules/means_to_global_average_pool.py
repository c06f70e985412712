"""Rule: write a quantized spatial mean as ``GlobalAveragePool`` so onnxruntime runs it on integers.

The exporter writes a CNN's global average pool (``x.mean((2, 3))``, ``adaptive_avg_pool2d(x, 1)``) as
``ReduceMean(axes=[-2, -1])``. Between a ``DequantizeLinear`` and a ``QuantizeLinear`` onnxruntime leaves it in
float (a DQ, a float reduction and a Q at run time); the same mean written as ``GlobalAveragePool`` fuses into
its integer ``QLinearGlobalAveragePool``. The rewrite::

    DQ -> ReduceMean(axes = last two of a 4-D input, keepdims=1) -> Q   ==>   DQ -> GlobalAveragePool -> Q
    DQ -> ReduceMean(..., keepdims=0) -> Q                              ==>   DQ -> GlobalAveragePool -> Q -> Flatten

``GlobalAveragePool`` of ``[N, C, H, W]`` is the mean over ``H, W`` with shape ``[N, C, 1, 1]``; ``Flatten(axis=1)``
moves the quantized ``[N, C, 1, 1]`` to ``[N, C]``. Only 4-D inputs (rank from the graph's shape annotations)
whose only reader is a ``QuantizeLinear`` are rewritten; other means of a dequantized 4-D (or unknown-rank) tensor
are near misses. A mean over a static 1 x 1 map is left as it is: there onnxruntime 1.32's
``QLinearGlobalAveragePool`` is the slower kernel (``[1, 1280, 1, 1]``, 1 thread, 300 interleaved rounds: 16.7 µs
against 8.2 µs for the float ``DQ -> ReduceMean -> Q``; at 4 x 4 it is 7.1 against 11.7 µs), and that is the
final pool of Hugging Face MobileNetV2 at 32 x 32 (1.11x ``quantize_static``'s latency in the audit).

Also an ``AveragePool`` whose window covers its whole (static) input, ``DQ -> AveragePool -> Q  ==>  DQ ->
GlobalAveragePool -> Q``: Hugging Face EfficientNet's pooler is ``AvgPool2d(1280, ceil_mode=True)`` on a 7 x 7 map.
torch and onnxruntime's float ``AveragePool`` average the ``H·W`` values inside the input (the window's part past
the edge is not padding, so it is not counted); onnxruntime's integer ``QLinearAveragePool`` does not (measured on
a 9 x 9 map: codes 133 steps low on average, up to 232). Rewritten when every kernel size is at least its input
size, the pads are 0 and the output is ``1 x 1``: then the pool is exactly the mean over ``H, W``.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["MeansToGlobalAveragePool"]


@dataclass(frozen=True)
class _Site(Match):
    quantize: onnx.NodeProto
    keepdims: bool


def _axes(node: onnx.NodeProto, graph: OnnxGraph) -> list[int] | None:
    attrs = attributes_of(node)
    if "axes" in attrs:  # opset < 18
        return [int(a) for a in attrs["axes"]]
    if len(node.input) > 1 and graph.initializer(node.input[1]) is not None:
        value = graph.constant(node.input[1])
        return None if value is None else [int(a) for a in value.reshape(-1)]
    return None


def _whole_input_pool(node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
    """An ``AveragePool`` between a DQ and a single Q whose window covers its whole static input (docstring)."""
    producer, users = graph.producer(node.input[0]), graph.readers(node.output[0])
    if producer is None or producer.op_type != "DequantizeLinear" or len(users) != 1 \
            or users[0].op_type != "QuantizeLinear" or node.output[0] in graph.outputs:
        return None
    shape, attrs = graph.shape(node.input[0]), attributes_of(node)
    kernel, pads = [int(k) for k in attrs.get("kernel_shape", [])], [int(p) for p in attrs.get("pads", [])]
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]) or len(kernel) != 2:
        return None  # a pool over a part of the map: nothing to fix
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    if any(k < d for k, d in zip(kernel, shape[2:], strict=True)) or any(pads) or auto_pad not in (b"NOTSET",
                                                                                                  "NOTSET"):
        return None
    output = graph.shape(node.output[0])
    if output is None or tuple(output[2:]) != (1, 1):
        return Fail("the window covers the input but the recorded output is not 1 x 1")
    return _Site(node, users[0], True)


class MeansToGlobalAveragePool(Rule):
    """Rewrite a quantized spatial ``ReduceMean`` of a 4-D tensor into ``GlobalAveragePool`` (module docstring)."""

    name = "means_to_global_average_pool"
    anchors = frozenset({"ReduceMean", "AveragePool"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``ReduceMean`` of a dequantized tensor that is (or may be) 4-D, or a whole-input ``AveragePool``."""
        if node.op_type == "AveragePool":
            return _whole_input_pool(node, graph)
        producer = graph.producer(node.input[0])
        rank = graph.rank(node.input[0])
        if producer is None or producer.op_type != "DequantizeLinear" or rank not in (4, None):
            return None  # e.g. a transformer's mean over the sequence: not a spatial pool
        if rank is None:
            return Fail("input rank is unknown (no shape recorded for it)")
        users = graph.readers(node.output[0])
        if node.output[0] in graph.outputs or len(users) != 1 or users[0].op_type != "QuantizeLinear":
            return Fail("the mean is not read by a single QuantizeLinear")
        axes = _axes(node, graph)
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            return Fail(f"it reduces axes {axes}, not the spatial axes [2, 3]")
        if tuple((graph.shape(node.input[0]) or (None,) * 4)[2:]) == (1, 1):
            return None  # a mean over a 1 x 1 map: onnxruntime's float path is the faster one (module docstring)
        return _Site(node, users[0], bool(int(attributes_of(node).get("keepdims", 1))))

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """``GlobalAveragePool`` in place of the mean; ``Q -> Flatten`` when the mean dropped the reduced axes."""
        node = match.node
        graph.replace(node, [helper.make_node("GlobalAveragePool", [node.input[0]], [node.output[0]],
                                              name=f"{node.name}_pool")])
        graph.forget_shapes({node.output[0]})  # [N, C] -> [N, C, 1, 1]
        if not match.keepdims:
            quantize = match.quantize
            pooled_q = graph.unique_name(f"{quantize.output[0]}_4d")
            graph.replace(quantize, [
                helper.make_node("QuantizeLinear", list(quantize.input), [pooled_q], name=quantize.name,
                                 **attributes_of(quantize)),
                helper.make_node("Flatten", [pooled_q], [quantize.output[0]], name=f"{node.name}_flatten", axis=1),
            ])
