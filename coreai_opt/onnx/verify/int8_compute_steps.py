"""The step of an int8-compute ``MatMulNBits`` in its output's units: what the ``"int8 compute"`` rule counts.

onnxruntime's int8-compute ``MatMulNBits`` (``accuracy_level=4``) quantizes its input ``A`` per row ``m`` and K block
``b`` to int8 codes with step ``s_x[m, b] = amax / 127``
(:mod:`coreai_opt.quantization.matmul_nbits.int8_compute`, emulated bit-exactly in eager). One code that differs by one
step moves output ``(m, n)`` by ``s_x[m, b(k)] · |w[n, k]|``, at most::

    u[m, n] = max_b s_x[m, b] · max_k |w[n, k]|

the unit :func:`int8_step_units` returns per output element (``w`` read back from the file's ``B`` / ``scales`` /
``zero_points``; ``s_x`` from onnxruntime's own ``A``, computed by a copy of the file with ``A`` added as a graph
output). :mod:`coreai_opt.onnx.verify.tolerance` says how many such units an output may differ by.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.verify.ort_kernels import is_int8_compute
from coreai_opt.quantization.matmul_nbits.int8_compute import INT8_COMPUTE_QMAX
from coreai_opt.quantization.matmul_nbits.packing import PackedMatMulNBits, unpack_matmul_nbits

__all__ = ["file_weight", "weight_column_max", "input_row_steps", "int8_step_units", "int8_layer_inputs",
           "beyond_int8_steps"]


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    node = next((n for n in model.graph.node if n.name == name and n.op_type == "MatMulNBits"), None)
    if node is None:
        raise ValueError(f"int8-compute MatMulNBits {name!r} is not in the file (onnxruntime's optimized graph names "
                         "it); re-export the model so the file carries the node verify_onnx derived a tolerance for")
    return node


def file_weight(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """The dequantized weight ``[N, K]`` (float32) of a ``MatMulNBits`` node of ``model``, from its initializers."""
    graph = OnnxGraph(model)
    attrs = {a.name: a.i for a in node.attribute}
    arrays = [graph.initializer(name) if name else None for name in list(node.input[1:4]) + [""] * 3][:3]
    if arrays[0] is None or arrays[1] is None:
        raise ValueError(f"MatMulNBits {node.name!r}: B and scales must be initializers of the file")
    b, scales, zero_points = (None if a is None else numpy_helper.to_array(a) for a in arrays)
    if zero_points is not None and zero_points.dtype != np.uint8:
        raise ValueError(f"MatMulNBits {node.name!r}: zero points of type {zero_points.dtype} (this reader handles "
                         "the uint8 ones export_onnx writes)")
    packed = PackedMatMulNBits(b, scales, zero_points, attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"])
    return unpack_matmul_nbits(packed)


def weight_column_max(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """``max_k |w[n, k]|`` per output column ``n`` of a ``MatMulNBits`` node of ``model`` (float64 ``[N]``)."""
    return np.abs(file_weight(model, node)).max(axis=1).astype(np.float64)


def input_row_steps(a: np.ndarray, block_size: int) -> np.ndarray:
    """``max_b s_x[m, b]`` per row of ``A`` (``s_x = amax / 127`` per K block), float64 ``[..., 1]``."""
    k = a.shape[-1]
    blocks = -(-k // block_size)
    padded = np.zeros((*a.shape[:-1], blocks * block_size), np.float32)
    padded[..., :k] = a
    amax = np.abs(padded.reshape(*a.shape[:-1], blocks, block_size)).max(axis=-1)
    return (amax.max(axis=-1, keepdims=True) / np.float32(INT8_COMPUTE_QMAX)).astype(np.float64)


def _inputs_of_layers(path: Path, model: onnx.ModelProto, tensors: list[str], feeds: Sequence[dict[str, np.ndarray]],
                      providers: Sequence[str]) -> list[list[np.ndarray]]:
    """The values onnxruntime computes for ``tensors`` per batch (a copy of the file with them as graph outputs)."""
    import onnxruntime as ort

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    existing = {o.name for o in copy.graph.output}
    copy.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in tensors if t not in existing)
    with tempfile.TemporaryDirectory(prefix="coreai_opt_int8_steps_") as tmp:
        cut = Path(tmp) / "with_int8_inputs.onnx"
        onnx.save(copy, str(cut), save_as_external_data=True, location="with_int8_inputs.onnx.data")
        del copy
        session = ort.InferenceSession(str(cut), providers=list(providers))
        return [session.run(tensors, feed) for feed in feeds]


def int8_step_units(path: str | Path, layers: dict[str, str], feeds: Sequence[dict[str, np.ndarray]],
                    providers: Sequence[str] = ("CPUExecutionProvider",)) -> dict[str, list[np.ndarray]]:
    """The unit ``u[m, n]`` (module docstring) of each int8-compute layer, per batch.

    Args:
        path: The ONNX file.
        layers: ``{output name: int8-compute MatMulNBits node name}`` (from the ``"int8 compute"`` tolerances).
        feeds: One onnxruntime feed per batch.
        providers: onnxruntime execution providers.

    Returns:
        ``{output name: [u per batch]}``, each ``u`` shaped ``A``'s rows × ``N`` (``[..., N]``).
    """
    path = Path(path)
    model = onnx.load(str(path))
    nodes = {name: _node(model, name) for name in dict.fromkeys(layers.values())}
    columns = {name: weight_column_max(model, node) for name, node in nodes.items()}
    tensors = list(dict.fromkeys(node.input[0] for node in nodes.values()))
    values = _inputs_of_layers(path, model, tensors, feeds, providers)
    del model
    units: dict[str, list[np.ndarray]] = {}
    for output, name in layers.items():
        node = nodes[name]
        block = next(a.i for a in node.attribute if a.name == "block_size")
        index = tensors.index(node.input[0])
        units[output] = [input_row_steps(batch[index], block) * columns[name] for batch in values]
    return units


def int8_layer_inputs(model: onnx.ModelProto) -> dict[str, str]:
    """``{node name: its input A}`` of every int8-compute ``MatMulNBits`` of ``model``."""
    return {node.name: node.input[0] for node in model.graph.node if is_int8_compute(node)}


def beyond_int8_steps(model: onnx.ModelProto, layer: str, steps: int, a: np.ndarray,
                      difference: np.ndarray) -> np.ndarray:
    """``max(|Δ| − steps · u, 0)`` per element: what ``steps`` int8 steps of ``layer`` do not explain.

    ``u`` comes from onnxruntime's input ``a`` of that layer (its largest value when the shapes differ).
    """
    node = _node(model, layer)
    block = next(attr.i for attr in node.attribute if attr.name == "block_size")
    unit = input_row_steps(a, block) * weight_column_max(model, node)
    if unit.shape != difference.shape:
        unit = np.full(difference.shape, float(unit.max(initial=0.0)))
    return np.maximum(difference - (steps + 1e-3) * unit, 0.0)
