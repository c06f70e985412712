"""Checks at the start of ``export_onnx`` that go beyond :func:`~coreai_opt.api.internals.input_checks.check_inputs`.

The inputs themselves (count, dtype, rank, shape of a torch.export capture, empty tensors, token ids) are checked by
the one input check that ``calibrate`` and ``verify_onnx`` use too. Two checks are the exporter's own; both raise
:class:`~coreai_opt.errors.InputValidationError`:

* an FX-captured model whose example differs from the recorded one outside the batch dimension is run once, and a
  failure is reported with both shapes (instead of ``mat1 and mat2 shapes cannot be multiplied`` from the exporter);
* input and output names must differ (ONNX value names are unique; the onnx checker says ``Duplicate definition``).

And bfloat16, which onnxruntime's CPU provider has no Conv / Gemm / MatMul / elementwise kernels for, is refused
(``ValueError``) where the file would compute in it: bfloat16 parameters or example inputs before the export
(:func:`refuse_bfloat16`), a bfloat16 constant read by anything but a ``Cast`` after it
(:func:`refuse_bfloat16_compute`). A bfloat16 *constant* cast to float32 by the model is fine: hf RecurrentGemma
keeps its embedding normalizer ``sqrt(hidden)`` as a bfloat16 buffer and multiplies by
``normalizer.type(hidden.dtype)``; refusing every bfloat16 buffer refused that float32 model.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import torch
from torch import Tensor, nn

from coreai_opt.api.internals.input_checks import differing_shape, input_check
from coreai_opt.errors import InputValidationError
from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["check_export_inputs", "check_io_names", "refuse_bfloat16", "refuse_bfloat16_compute"]

_WHERE = "export_onnx example_inputs"


def check_export_inputs(model: nn.Module, inputs: Sequence[Tensor]) -> None:
    """Check ``export_onnx``'s example inputs against the recorded example inputs (module docstring).

    Raises:
        InputValidationError: naming the input, the recorded dtype / shape and the fix.
    """
    check = input_check(model)
    if check is None:
        return
    check(inputs, {}, _WHERE)
    differing = differing_shape(check.meta, check.given(inputs, {}))  # an export capture was refused above
    if differing is None:
        return
    spec, shape = differing
    try:
        with torch.no_grad():
            model(*inputs)
    except RuntimeError as exc:
        raise InputValidationError(
            f"{_WHERE}: the model fails on input '{spec.name}' of shape {shape} (prepare had {spec.shape}): {exc}; "
            f"pass example inputs of shape {spec.shape} (only the batch dimension may change)"
        ) from exc


def check_io_names(input_names: Sequence[str], output_names: Sequence[str]) -> None:
    """Refuse a name used for an input and an output (ONNX value names must be unique).

    Raises:
        InputValidationError: naming the clashing names.
    """
    clash = sorted(set(input_names) & set(output_names))
    if clash:
        raise InputValidationError(
            f"export_onnx: {clash} would name both a graph input and a graph output (inputs {list(input_names)}, "
            f"outputs {list(output_names)}); ONNX value names must be unique: pass output_names (or input_names) "
            "with different names"
        )


_BFLOAT16_FIX = ("onnxruntime's CPU provider has no bfloat16 Conv/Gemm/MatMul kernels; export a float32 or float16 "
                 "copy instead (e.g. model.float() and float32 example inputs), which keeps the float32 qparams")


def refuse_bfloat16(model: nn.Module, inputs: Sequence[Tensor]) -> None:
    """Raise ``ValueError`` when the model's parameters or the example inputs are bfloat16."""
    tensors = [*model.parameters(), *inputs]
    if any(isinstance(t, Tensor) and t.dtype == torch.bfloat16 for t in tensors):
        raise ValueError(f"the model's parameters or its example inputs are bfloat16, and {_BFLOAT16_FIX}")


def refuse_bfloat16_compute(model: onnx.ModelProto) -> None:
    """Raise ``ValueError`` when the exported graph computes in bfloat16 (a bfloat16 buffer used as it is)."""
    graph = OnnxGraph(model)
    for constant in graph.initializers():
        readers = [] if constant.data_type != onnx.TensorProto.BFLOAT16 else graph.readers(constant.name)
        computing = next((node for node in readers if node.op_type != "Cast"), None)
        if computing is not None:
            _refuse_bfloat16_node(computing, f"reads the bfloat16 constant {constant.name!r}")
    for node in graph.nodes:
        if node.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for a in node.attribute):
            _refuse_bfloat16_node(node, "casts to bfloat16")


def _refuse_bfloat16_node(node: onnx.NodeProto, what: str) -> None:
    raise ValueError(f"the exported graph computes in bfloat16 (node {node.name!r}, {node.op_type}, {what}: "
                     f"a bfloat16 buffer of the model used as it is), and {_BFLOAT16_FIX}")
