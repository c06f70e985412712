"""Quantize the large constant weights of an export chunk by chunk, so the fold never needs a float copy of them.

``export_onnx`` folds every ``weight -> QuantizeLinear -> DequantizeLinear`` chain into an integer initializer
(:class:`~coreai_opt.onnx.rewrite.rules.fold_quantized_weights.FoldQuantizedWeights`). Left to itself the fold needs the
float weight inside the protobuf (a second float copy of every weight) and evaluates each ``QuantizeLinear`` on the
whole tensor (float32 and float64 temporaries several times its size). For each weight of at least
:data:`PREQUANTIZE_MIN_BYTES` this module evaluates that ``QuantizeLinear`` beforehand with the fold's own evaluator
(:func:`~coreai_opt.onnx.rewrite.constant_folder.evaluate_node`), on row chunks of about :data:`CHUNK_BYTES`:
quantization is elementwise given its qparams, and the qparams are sliced with the rows (per-channel along axis 0,
blocked), so every integer is the one the whole-tensor evaluation gives. The integers go to the fold as precomputed
values (``rewrite.apply(model, rules, precomputed=...)``), and the fold rewrites exactly as it would have (same
integers, initializer names and order, report and ``value_info``): the file is byte-identical.

The two export routes:

* dynamo (:func:`defer_large_weights`), on the exporter's in-memory ``onnx_ir`` model before it is serialised: each
  large float weight's tensor is replaced by a placeholder (external data at :data:`DEFERRED_LOCATION`, no bytes),
  so the float weights never reach the protobuf; the fold removes the placeholders with their chains and
  :func:`check_no_deferred_weights` proves none is left. The integers are computed when the fold reads them
  (:class:`DeferredValues`), so only one weight's integers exist outside the file's tensors at a time (a 1.1 B
  decoder's were 1.1 GB held at once).
* TorchScript fallback (:func:`prequantize_initializers`), on the protobuf: that exporter serialises the model
  itself, float weights included, before coreai_opt sees it, so its float copy cannot be avoided; the chunks still
  bound the fold's temporaries to a few :data:`CHUNK_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Protocol, runtime_checkable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.onnx.rewrite.constant_folder import ConstantFolder, evaluate_node
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import axis_and_block
from coreai_opt.onnx.rewrite.row_chunks import qparam_rows, row_ranges

__all__ = ["CHUNK_BYTES", "DEFERRED_LOCATION", "DETACHED_LOCATION", "PREQUANTIZE_MIN_BYTES", "DeferredValues",
           "check_no_deferred_weights", "defer_large_weights", "detach_large_initializers", "prequantize_initializers",
           "quantize_rows"]

#: Float weights at least this large are quantized in chunks before the fold; smaller ones by the fold itself.
PREQUANTIZE_MIN_BYTES = 1 << 20
#: Float bytes of the rows quantized at a time (the evaluator's temporaries are a few times this).
CHUNK_BYTES = 4 << 20
#: External-data location of the placeholders that stand for deferred float weights in the serialised model.
DEFERRED_LOCATION = "coreai_opt-deferred-float-weight"
#: External-data location of the stubs of the initializers :func:`detach_large_initializers` holds outside it.
DETACHED_LOCATION = "coreai_opt-detached-initializer"
_STANDARD = ("", "ai.onnx")


def quantize_rows(node: onnx.NodeProto, weight: np.ndarray | RowSlices, scale: np.ndarray,
                  zero_point: np.ndarray | None) -> np.ndarray | None:
    """``QuantizeLinear`` ``node`` of ``weight``, evaluated on row chunks of about :data:`CHUNK_BYTES`.

    Args:
        node: The ``QuantizeLinear`` (its attributes: axis, block size, output type, saturation).
        weight: The float weight (rank >= 1; not modified), or a reader of its rows (a rounded weight, whose
            whole float value is never held: :class:`coreai_opt.onnx.export.rounded_weights.RoundedWeightTensor`).
        scale: Its scale, as the node reads it.
        zero_point: Its zero point, None when the node has none.

    Returns:
        The quantized weight, equal to evaluating the node on the whole tensor; None when the evaluator refuses it
        (the fold then refuses it too and says why).
    """
    axis, block_size = axis_and_block(node)
    out: np.ndarray | None = None
    for rows in row_ranges(weight.shape, axis % weight.ndim, block_size, CHUNK_BYTES):
        chunk = _evaluate_rows(node, weight, scale, zero_point, rows)
        if not isinstance(chunk, np.ndarray):
            return None
        if out is None:
            out = np.empty(weight.shape, dtype=chunk.dtype)
        out[rows] = chunk
    return out


def _evaluate_rows(node: onnx.NodeProto, weight: np.ndarray | RowSlices, scale: np.ndarray,
                   zero_point: np.ndarray | None, rows: slice) -> np.ndarray | str | None:
    """``QuantizeLinear`` ``node`` on ``rows`` of ``weight``, its qparams sliced to the same rows."""
    axis, block_size = axis_and_block(node)
    axis %= weight.ndim
    inputs = [weight[rows], qparam_rows(scale, axis, block_size, rows)]
    if zero_point is not None:
        inputs.append(qparam_rows(zero_point, axis, block_size, rows))
    return evaluate_node(node, inputs)


@runtime_checkable
class ReadsRows(Protocol):
    """An ``onnx_ir`` tensor whose value can also be read a slice of rows (axis 0) at a time."""

    def row_slices(self) -> RowSlices:
        """The value as an array-like that :func:`quantize_rows` slices by rows."""


class RowSlices(Protocol):
    """What :func:`quantize_rows` reads: ``shape``, ``ndim`` and ``[rows]`` (a numpy array is one)."""

    shape: tuple[int, ...]
    ndim: int

    def __getitem__(self, rows: slice) -> np.ndarray: ...


def _refuses(node: onnx.NodeProto, shape: tuple[int, ...], scale: np.ndarray, zero_point: np.ndarray | None) -> bool:
    """Whether the evaluator refuses ``node`` on a float32 weight of ``shape`` (probed on one chunk of zeros).

    Refusals depend on the dtypes, attributes and zero point only, never on the weight's values.
    """
    axis, block_size = axis_and_block(node)
    rows = row_ranges(shape, axis % len(shape), block_size, CHUNK_BYTES)[0]
    probe = np.zeros(shape, dtype=np.float32)  # untouched zero pages: only the first chunk is ever read
    return not isinstance(_evaluate_rows(node, probe, scale, zero_point, rows), np.ndarray)


class DeferredValues(MutableMapping[str, np.ndarray]):
    """``{name: value}`` whose values are computed each time they are read (the fold reads each once, then deletes it).

    What :func:`defer_large_weights` returns: holding every large weight's integers at once would be a second copy
    of the file's tensors (one byte per weight element) beside the file being written.
    """

    def __init__(self) -> None:
        self._compute: dict[str, Callable[[], np.ndarray]] = {}

    def defer(self, name: str, compute: Callable[[], np.ndarray]) -> None:
        """Make ``compute()`` the value of ``name``."""
        self._compute[name] = compute

    def __getitem__(self, name: str) -> np.ndarray:
        return self._compute[name]()

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._compute[name] = lambda: value

    def __delitem__(self, name: str) -> None:
        del self._compute[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._compute)

    def __len__(self) -> int:
        return len(self._compute)


def _only_dequantized(uses: list[tuple[object, int]]) -> bool:
    """Every use is input 0 of a standard ``DequantizeLinear`` (so the fold removes the whole chain)."""
    return bool(uses) and all(getattr(node, "op_type", None) == "DequantizeLinear" and node.domain in _STANDARD
                              and index == 0 for node, index in uses)


def _constant_array(value: ir.Value | None, depth: int = 4) -> np.ndarray | None:
    """The value of a small constant: an initializer, or a short chain the fold's evaluator computes from ones.

    The exporter's optimizer folds constants of up to 8192 elements only, so a per-channel zero point of a wider
    layer arrives as ``Cast(initializer)``.
    """
    if value is None:
        return None
    if value.is_initializer():
        return None if value.const_value is None else value.const_value.numpy()
    node = value.producer()
    if node is None or depth == 0 or node.domain not in _STANDARD or len(node.outputs) != 1:
        return None
    inputs = [_constant_array(v, depth - 1) if v is not None else None for v in node.inputs]
    if any(v is not None and a is None for v, a in zip(node.inputs, inputs, strict=True)):
        return None
    result = evaluate_node(ir.serde.serialize_node(node), inputs)
    return result if isinstance(result, np.ndarray) else None


def defer_large_weights(model: ir.Model, min_bytes: int | None = None) -> DeferredValues:
    """Quantize the large weight chains of the exporter's model in chunks; leave placeholders for their floats.

    A chain is a float32 initializer of at least ``min_bytes`` read only by one standard ``QuantizeLinear`` with
    constant qparams, whose output only ``DequantizeLinear`` nodes read (as their data).

    Args:
        model: The exporter's in-memory model (``ONNXProgram.model``); the chains' float tensors are replaced by
            placeholders in place (the graph is otherwise unchanged).
        min_bytes: Smallest weight handled (default :data:`PREQUANTIZE_MIN_BYTES`).

    Returns:
        ``{QuantizeLinear output name: quantized weight}`` (computed when read), for ``rewrite.apply(...,
        precomputed=...)``.
    """
    min_bytes = PREQUANTIZE_MIN_BYTES if min_bytes is None else min_bytes
    graph = model.graph
    outputs = {id(v) for v in graph.outputs} | {id(v) for v in graph.inputs}
    values = DeferredValues()
    for node in graph:
        if node.op_type != "QuantizeLinear" or node.domain not in _STANDARD or len(node.outputs) != 1:
            continue
        weight = node.inputs[0]
        tensor = weight.const_value if weight is not None and weight.is_initializer() else None
        if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) == 0 or tensor.nbytes < min_bytes:
            continue
        if id(weight) in outputs or len(weight.uses()) != 1 or id(node.outputs[0]) in outputs:
            continue
        if not _only_dequantized(list(node.outputs[0].uses())):
            continue
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        scale, zero_point_array = _constant_array(node.inputs[1]), _constant_array(zero_point)
        if scale is None or (zero_point is not None and zero_point_array is None):
            continue
        proto = ir.serde.serialize_node(node)
        if _refuses(proto, tuple(tensor.shape.numpy()), scale, zero_point_array):
            continue
        values.defer(node.outputs[0].name, _quantizer(proto, tensor, scale, zero_point_array))
        weight.const_value = ir.ExternalTensor(DEFERRED_LOCATION, 0, tensor.nbytes, tensor.dtype,
                                               shape=tensor.shape, name=tensor.name or weight.name)
        del tensor
    return values


def _quantizer(node: onnx.NodeProto, tensor: ir.TensorProtocol, scale: np.ndarray,
               zero_point: np.ndarray | None) -> Callable[[], np.ndarray]:
    """``quantize_rows`` of ``tensor``'s value, read when called (an ``onnx_ir`` tensor over the model's memory)."""

    def compute() -> np.ndarray:
        weight = tensor.row_slices() if isinstance(tensor, ReadsRows) else tensor.numpy()
        quantized = quantize_rows(node, weight, scale, zero_point)
        if quantized is None:  # _refuses said it would not
            raise CoreaiOptRuntimeError(f"internal error: quantizing {tensor.name} was refused after a probe "
                                        "accepted it; please report it")
        return quantized

    return compute


def detach_large_initializers(model: ir.Model, min_bytes: int | None = None) -> dict[str, onnx.TensorProto]:
    """Serialise every remaining initializer of at least ``min_bytes`` on its own, leaving a stub in ``model``.

    Run after :func:`defer_large_weights`, before the model is serialised: the per-block scales and zero points of a
    4-bit decoder (0.28 GB at 1.1 B parameters) and any float weight left unquantized would otherwise sit in the
    ``ModelProto``'s arena for the whole export, replaced or not (:mod:`coreai_opt.onnx.rewrite.initializers`).
    Each gets the bytes the exporter's own serialisation writes (``onnx_ir.serde.serialize_tensor``, named after
    its value); ``rewrite.apply(..., detached=...)`` takes them over and the save streams them.

    Returns:
        ``{initializer name: its TensorProto}``.
    """
    min_bytes = PREQUANTIZE_MIN_BYTES if min_bytes is None else min_bytes
    inputs = {v.name for v in model.graph.inputs}
    detached: dict[str, onnx.TensorProto] = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.ExternalTensor) or name in inputs or tensor.nbytes < min_bytes:
            continue
        tensor.name = name
        detached[name] = ir.serde.serialize_tensor(tensor)
        value.const_value = ir.ExternalTensor(DETACHED_LOCATION, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                              name=name)
    return detached


def prequantize_initializers(model: onnx.ModelProto, min_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The TorchScript route's counterpart of :func:`defer_large_weights`: the same chains, found in the protobuf.

    The float weights stay in ``model`` (the exporter serialised them already); only the fold's evaluation is
    chunked.

    Returns:
        ``{QuantizeLinear output name: quantized weight}``, for ``rewrite.apply(..., precomputed=...)``.
    """
    min_bytes = PREQUANTIZE_MIN_BYTES if min_bytes is None else min_bytes
    graph = OnnxGraph(model)
    folder = ConstantFolder(graph)
    values: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        if node.op_type != "QuantizeLinear" or node.domain not in _STANDARD or len(node.output) != 1:
            continue
        name = node.input[0]
        tensor = graph.initializer(name)
        if tensor is None or tensor.data_type != onnx.TensorProto.FLOAT or not tensor.dims or name in graph.inputs:
            continue
        weight_readers, output = graph.readers(name), node.output[0]
        if 4 * int(np.prod(tensor.dims)) < min_bytes or len(weight_readers) != 1 or weight_readers[0] is not node:
            continue
        if output in graph.outputs or not _only_dequantized([(r, list(r.input).index(output))
                                                            for r in graph.readers(output)]):
            continue
        zero_point = node.input[2] if len(node.input) > 2 else ""
        scale, zero_point_array = folder.value(node.input[1]), folder.value(zero_point) if zero_point else None
        if scale is None or (zero_point and zero_point_array is None):
            continue
        quantized = quantize_rows(node, numpy_helper.to_array(tensor), scale, zero_point_array)
        if quantized is not None:
            values[node.output[0]] = quantized
    return values


def check_no_deferred_weights(model: onnx.ModelProto, detached: dict[str, onnx.TensorProto] | None = None) -> None:
    """Raise if a placeholder the export left in ``model`` would be a missing weight in the file.

    That is a placeholder of :func:`defer_large_weights` the fold did not replace, or a stub of
    :func:`detach_large_initializers` with no tensor in ``detached``.

    Raises:
        CoreaiOptRuntimeError: names the weights; a coreai_opt bug, never expected.
    """
    held = detached or {}
    left = [t.name for t in model.graph.initializer
            if any(e.key == "location" and (e.value == DEFERRED_LOCATION
                                            or (e.value == DETACHED_LOCATION and t.name not in held))
                   for e in t.external_data)]
    if left:
        raise CoreaiOptRuntimeError(
            f"internal error: the weights {left[:5]} were quantized ahead of the fold but the fold did not replace "
            "them, so the file would lack their values; please report it. Workaround: set "
            "coreai_opt.onnx.export.prequantize_weights.PREQUANTIZE_MIN_BYTES above the largest weight's size")
