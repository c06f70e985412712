r"""The file's stored weights against eager's, one weight quantizer at a time: every code must be the same.

The activation codes (:mod:`coreai_opt.onnx.verify.quantizer_codes`) see a wrong weight only through what it does to
the next quantizer, where a few changed codes can hide among rounding flips (2 % of one weight's codes moved by 3
steps moved a linear's output by 0.0025 in the zoo's ``shape_unpack``). The weights themselves need no inference:
for each weight quantizer of the converted model that reads a parameter (``get_attr → quantizer``), its eager value
:math:`\hat W = \mathrm{fq}(W)` is compared with the file's ``DequantizeLinear`` of the stored integers,
:math:`(q - z) \cdot s` (the initializer ``fold_quantized_weights`` names ``<parameter>_quantized``, or the
parameter's own name; stored transposed by ``fold_weight_transposes`` is read back transposed). Both sides compute
:math:`(q - z) s` in float32 from the same integers, scales and zero points, so a clean file agrees exactly; a
difference of half a step (:math:`|\Delta| \ge s / 2`) anywhere is a different code or grid, and fails.

Compared: 8-bit integer weights, per tensor or per channel. Not compared (counted in
:attr:`WeightCheck.skipped`): packed 4-bit ``MatMulNBits`` / per-block weights, a weight quantizer after a
transpose (``sink_weight_quantizers``), a weight whose initializer the file renamed or stacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import fx, nn

from coreai_opt.graph.graph_attrs import get_attr_value
from coreai_opt.graph.node_meta import Role, called_quantizer, get_meta
from coreai_opt.graph.op_kinds import OpKind, lookup_op
from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["WeightCheck", "WeightCodes", "compare_weight_codes"]

_EIGHT_BIT = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


@dataclass(frozen=True)
class WeightCodes:
    """One weight: the file's dequantized integers against eager's fake-quantized value.

    Attributes:
        module: The eager weight quantizer's module name.
        initializer: The file's initializer holding the codes.
        codes: Codes compared.
        differing: Codes whose dequantized values differ by half a step or more.
        max_steps: Largest difference in steps of the file's scale.
    """

    module: str
    initializer: str
    codes: int
    differing: int
    max_steps: float

    @property
    def ok(self) -> bool:
        """True when every code is the same."""
        return self.differing == 0

    def __str__(self) -> str:
        return (f"weight {self.module} ({self.initializer}): {self.differing} of {self.codes} codes differ "
                f"(max {self.max_steps:.3g} steps)")


@dataclass(frozen=True)
class WeightCheck:
    """Every compared weight, and how many weight quantizers the check could not pair with a stored weight."""

    weights: tuple[WeightCodes, ...] = ()
    skipped: int = 0

    @property
    def ok(self) -> bool:
        """True when every compared weight has the same codes."""
        return all(w.ok for w in self.weights)

    @property
    def first_failing(self) -> WeightCodes | None:
        """The first weight, in graph order, with a differing code."""
        return next((w for w in self.weights if not w.ok), None)


def _dequantize_node(graph: OnnxGraph, initializer: str) -> onnx.NodeProto | None:
    readers = graph.readers(initializer)
    return next((n for n in readers if n.op_type == "DequantizeLinear" and n.input[0] == initializer), None)


def _file_multiplies_by_transpose(graph: OnnxGraph, value: str) -> bool | None:
    """Whether the file's matrix products read ``value`` transposed (Gemm ``transB=1``), or None for a non-product.

    MatMul and Gemm ``transB=0`` read it as it is; one ``Transpose`` in between flips the answer; any other reader
    (conv, gather, ...) gives None. Several readers (a layer the model runs more than once, e.g. HRM's recurrent
    modules unrolled) must all agree, else None.
    """
    answers = {_reads_transposed(graph, value, reader) for reader in graph.readers(value)}
    return answers.pop() if len(answers) == 1 else None


def _reads_transposed(graph: OnnxGraph, value: str, reader: onnx.NodeProto) -> bool | None:
    if reader.op_type == "Transpose" and len(reader.output) == 1:
        inner = _file_multiplies_by_transpose(graph, reader.output[0])
        return None if inner is None else not inner
    if reader.op_type == "MatMul" and list(reader.input).index(value) == 1:
        return False
    if reader.op_type == "Gemm" and list(reader.input).index(value) == 1:
        return any(a.name == "transB" and a.i == 1 for a in reader.attribute)
    return None


def _eager_multiplies_by_transpose(model: fx.GraphModule, quantizer: fx.Node) -> bool | None:
    """Whether eager's readers use the weight as ``Wᵀ`` (``F.linear``), ``W`` (``matmul`` / ``addmm``), or None.

    Several readers must all agree, else None.
    """
    answers = set()
    for reader in quantizer.users:
        kind = get_meta(reader).kind
        if kind is OpKind.LINEAR:
            answers.add(lookup_op(reader, model).layout.weight_axes is None)  # canonical [out, in]: x @ Wᵀ
        else:
            answers.add(False if kind is OpKind.MATMUL else None)
    return answers.pop() if len(answers) == 1 else None


class _Stored:
    """A stored weight: its integer codes (as stored, 1 byte each), scale and zero point shaped to broadcast."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> None:
        self.codes, self.scale, self.zero = codes, scale, zero

    def compare(self, eager: np.ndarray) -> tuple[int, float]:
        """``(codes differing by half a step or more, largest difference in steps)`` against ``eager``, by rows.

        Rows are dequantized a slice at a time (about :data:`_CHUNK_ELEMENTS` values), so a large weight never has
        a float copy of the file's side in memory.
        """
        rows = max(1, _CHUNK_ELEMENTS // max(1, int(np.prod(self.codes.shape[1:]))))
        differing, largest = 0, 0.0
        for start in range(0, self.codes.shape[0], rows):
            part = slice(start, start + rows)
            scale = self.scale[part] if self.scale.shape[0] > 1 else self.scale
            zero = self.zero[part] if self.zero.shape[0] > 1 else self.zero
            steps = np.abs((self.codes[part].astype(np.float32) - zero) * scale - eager[part])
            steps /= np.maximum(np.abs(scale), np.finfo(np.float32).tiny)
            differing += int((steps >= 0.5).sum())
            largest = max(largest, float(steps.max(initial=0.0)))
        return differing, largest


#: Values dequantized at a time when comparing one weight.
_CHUNK_ELEMENTS = 1 << 22


def _stored(node: onnx.NodeProto, tensors: dict[str, onnx.TensorProto], base: Path) -> _Stored | None:
    """The weight a ``DequantizeLinear`` reads, or None for a layout this check does not read."""
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attributes.get("block_size", 0) or len(node.input) < 2 or node.input[1] not in tensors:
        return None
    stored = tensors[node.input[0]]
    if stored.data_type not in _EIGHT_BIT:
        return None
    codes = numpy_helper.to_array(stored, base_dir=str(base))
    scale = numpy_helper.to_array(tensors[node.input[1]], base_dir=str(base)).astype(np.float32)
    zero = (numpy_helper.to_array(tensors[node.input[2]], base_dir=str(base)).astype(np.float32)
            if len(node.input) > 2 and node.input[2] in tensors else np.zeros_like(scale))
    shape = [1] * codes.ndim
    if scale.ndim == 1 and scale.size > 1:  # per axis: DequantizeLinear's axis defaults to 1
        shape[int(attributes.get("axis", 1)) % codes.ndim] = scale.size
    return _Stored(codes, scale.reshape(shape), zero.reshape(shape))


def compare_weight_codes(model: nn.Module, graph_model: onnx.ModelProto, base: Path) -> WeightCheck:
    """Compare every 8-bit weight the file stores with the converted ``model``'s (module docstring).

    Args:
        model: The converted model that was exported (a GraphModule; any other module compares nothing).
        graph_model: The file's protobuf (its external data, if any, is read from ``base``).
        base: The file's folder.
    """
    if not isinstance(model, fx.GraphModule):
        return WeightCheck()
    tensors = {t.name: t for t in graph_model.graph.initializer}
    graph = OnnxGraph(graph_model)  # reader index: each lookup below without a scan of every node
    weights, skipped = [], 0
    for node in model.graph.nodes:
        quantizer = called_quantizer(model, node, Role.WEIGHT)
        if quantizer is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        parameter = get_attr_value(node.args[0], model)
        if not isinstance(parameter, torch.Tensor):
            skipped += 1  # a weight quantizer after a transpose / view
            continue
        target = str(node.args[0].target)
        name = next((n for n in (f"{target}_quantized", target) if n in tensors), None)
        dequantize = _dequantize_node(graph, name) if name is not None else None
        stored = _stored(dequantize, tensors, base) if dequantize is not None else None
        if stored is None:
            skipped += 1
            continue
        with torch.no_grad():  # one fake-quantized weight in memory at a time
            eager = quantizer(parameter.detach()).float().numpy()
        if eager.ndim == 2:  # a matrix product's operand: read back in the orientation both products use
            in_file = _file_multiplies_by_transpose(graph, dequantize.output[0])
            in_eager = _eager_multiplies_by_transpose(model, node)
            if in_file is not None and in_eager is not None and in_file != in_eager:
                eager = eager.T  # stored transposed (fold_weight_transposes)
            elif (in_file is None) != (in_eager is None) and eager.shape[0] == eager.shape[1]:
                skipped += 1  # a square product operand whose orientation one side leaves open: both would fit
                continue
        if eager.shape != stored.codes.shape:
            skipped += 1
            continue
        differing, largest = stored.compare(eager)
        weights.append(WeightCodes(str(node.target), name, int(stored.codes.size), differing, largest))
        del eager, stored
    return WeightCheck(tuple(weights), skipped)
