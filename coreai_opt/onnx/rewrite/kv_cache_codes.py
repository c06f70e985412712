r"""A decoder file's quantized KV cache, read as codes: ``Concat(past, S · Cast(q))``, one scale per head and channel.

:mod:`coreai_opt.passes.quantize_kv_cache` quantizes the keys / values each step appends with a scale ``S`` of
shape ``(1, H_kv, 1, D)`` (one per head and channel), which the exporter writes in elementwise ops
(:mod:`~coreai_opt.quantization.ops.quantize_dequantize_op`; ``QuantizeLinear`` has no multi-axis scale)::

    q = Cast<int8>(Clip(Round(k / S) + z, -128, 127))        y = (Cast<float>(q) - z) · S,   z = 0

Every cached position went through the same quantizer, so the cache can be stored as the codes ``q`` and read
back exactly as ``Cast(q) · S`` (the same float32 products). The rules ``attention_to_group_query_attention``
(``GroupQueryAttention`` with an int8 cache and ``k_scale`` / ``v_scale``) and ``int8_kv_cache`` (any other
attention) find it with :func:`cache_codes` and type the graph's cache inputs and outputs with
:func:`store_as_codes`; the scale is kept in the file as ``<present name>_scale``, where ``verify_onnx`` finds it
to compare the cache with eager's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of

__all__ = ["CacheCodes", "cache_codes", "cache_concat", "store_as_codes", "scale_name_of"]


@dataclass(frozen=True)
class CacheCodes:
    """The quantizer of one cache tensor's new positions.

    Attributes:
        new: The float tensor it quantizes (``(batch, H_kv, sequence, D)``).
        codes: The int8 codes of the new positions (the ``Cast<int8>`` output).
        scale: ``S``, float32 of shape ``(1, H_kv, 1, D)``.
        elem_type: ONNX element type of the codes (``INT8``).
    """

    new: str
    codes: str
    scale: np.ndarray
    elem_type: int


def _op(graph: OnnxGraph, name: str, op_type: str) -> onnx.NodeProto | None:
    node = graph.producer(name)
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _operands(graph: OnnxGraph, node: onnx.NodeProto) -> tuple[str, np.ndarray] | None:
    """``(variable, constant)`` of a two-input node with one constant operand, else None."""
    constants = [graph.constant(name) for name in node.input]
    if len(node.input) != 2 or (constants[0] is None) == (constants[1] is None):
        return None
    return (node.input[1], constants[0]) if constants[0] is not None else (node.input[0], constants[1])


def _zero_point_term(graph: OnnxGraph, name: str, op_type: str) -> str | None:
    """``x`` of ``Add / Sub(x, 0)`` (the float zero point of a symmetric quantizer), or ``name`` itself."""
    node = _op(graph, name, op_type)
    if node is None:
        return name
    operands = _operands(graph, node)
    if operands is None or np.any(operands[1]) or (op_type == "Sub" and operands[0] != node.input[0]):
        return None
    return operands[0]


def cache_concat(graph: OnnxGraph, node: onnx.NodeProto | None) -> onnx.NodeProto | None:
    """``node`` when it is ``Concat(past graph input, new, axis=2)`` writing a graph output (a layer's cache)."""
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if node.output[0] not in graph.outputs or node.input[0] not in graph.inputs:
        return None
    return node if attributes_of(node).get("axis") in (2, -2) else None


def cache_codes(graph: OnnxGraph, name: str) -> CacheCodes | None:
    """The codes behind ``name`` = ``(Cast(q) - 0) · S`` with ``q = Cast<int8>(Clip(Round(k / S) + 0, -128, 127))``.

    None unless both ``S`` are the same constant ``(1, H_kv, 1, D)`` float32, the zero point is 0 (symmetric),
    the bounds are int8's and the codes are read by the one ``Cast`` back to float only.
    """
    mul = _op(graph, name, "Mul")
    operands = _operands(graph, mul) if mul is not None else None
    if operands is None:
        return None
    scaled, scale = operands
    if scale.ndim != 4 or scale.shape[0] != 1 or scale.shape[2] != 1 or scale.dtype != np.float32:
        return None
    back = _zero_point_term(graph, scaled, "Sub")
    to_float = _op(graph, back, "Cast") if back is not None else None
    codes = to_float.input[0] if to_float is not None else None
    to_int = _op(graph, codes, "Cast") if codes is not None else None
    if to_int is None or attributes_of(to_int).get("to") != onnx.TensorProto.INT8 or len(graph.readers(codes)) != 1:
        return None
    clip = _op(graph, to_int.input[0], "Clip")
    bounds = [graph.constant(b) for b in clip.input[1:3]] if clip is not None and len(clip.input) == 3 else []
    if len(bounds) != 2 or any(b is None for b in bounds) or (float(bounds[0]), float(bounds[1])) != (-128.0, 127.0):
        return None
    rounded = _zero_point_term(graph, clip.input[0], "Add")
    round_node = _op(graph, rounded, "Round") if rounded is not None else None
    div = _op(graph, round_node.input[0], "Div") if round_node is not None else None
    if div is None or graph.constant(div.input[1]) is None or not np.array_equal(graph.constant(div.input[1]), scale):
        return None
    return CacheCodes(div.input[0], codes, scale, onnx.TensorProto.INT8)


def scale_name_of(present: str) -> str:
    """The initializer name of a cache output's scale (``present.0.key`` -> ``present.0.key_scale``)."""
    return f"{present}_scale"


def store_as_codes(graph: OnnxGraph, past: str, present: str, codes: CacheCodes) -> str:
    """Type graph input ``past`` and output ``present`` as the codes' type; return the scale's initializer name.

    The element type of a graph input / output is not part of :class:`OnnxGraph`'s index (names, producers,
    readers, shapes), so it is set on the protobuf directly.
    """
    for value in (*graph.proto.input, *graph.proto.output):
        if value.name in (past, present):
            value.type.tensor_type.elem_type = codes.elem_type
    graph.edits += 1
    name = scale_name_of(present)
    return name if graph.initializer(name) is not None else graph.add_initializer(name, codes.scale)
