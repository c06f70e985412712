"""Checks at the start of ``export_onnx`` and ``verify_onnx``: the inputs fit what ``prepare`` recorded.

Without them the exporter or onnxruntime fail deep inside with errors that name neither the input nor the fix
(``mat1 and mat2 shapes cannot be multiplied``, ``indices element out of data bounds``, the onnx checker's
``Duplicate definition``). Every check raises :class:`~coreai_opt.errors.InputValidationError` (a ``ValueError``):

* count, dtype, rank, empty tensors and token ids of every input
  (:func:`coreai_opt.api.internals.input_checks.check_model_inputs`);
* non-batch dimensions: a model captured with ``torch.export`` is specialised to the recorded ones; an FX-captured
  model whose example differs is run once and a failure is reported with both shapes;
* input and output names must differ (ONNX value names are unique).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from coreai_opt.api.internals.input_checks import check_model_inputs, given_inputs, prepared_meta
from coreai_opt.errors import InputValidationError

__all__ = ["check_export_inputs", "check_io_names", "check_verify_batches"]


def _differing_shape(model: nn.Module, inputs: Sequence[Tensor]) -> tuple[str, tuple[int, ...], list[int]] | None:
    """The first input whose non-batch dimensions differ from the example given to prepare, if any."""
    meta = prepared_meta(model)
    if meta is None:
        return None
    given = given_inputs(list(meta.get("input_names", [])), inputs, {})
    for spec in meta.get("input_specs", []):
        value = given.get(spec["name"])
        if isinstance(value, Tensor) and list(value.shape[1:]) != list(spec["shape"][1:]):
            return spec["name"], tuple(value.shape), list(spec["shape"])
    return None


def check_export_inputs(model: nn.Module, inputs: Sequence[Tensor]) -> None:
    """Check ``export_onnx``'s example inputs against the recorded example inputs (module docstring).

    Raises:
        InputValidationError: naming the input, the recorded dtype / shape and the fix.
    """
    check_model_inputs(model, inputs, "export_onnx example_inputs")
    differing = _differing_shape(model, inputs)
    if differing is None:
        return
    name, shape, recorded = differing
    fix = f"pass example inputs of shape {tuple(recorded)} (only the batch dimension may change)"
    meta = prepared_meta(model)
    if meta is not None and meta.get("capture") == "export":
        raise InputValidationError(
            f"export_onnx example_inputs: input '{name}' has shape {shape} but the model was captured with "
            f"torch.export for {tuple(recorded)}; {fix}"
        )
    try:
        with torch.no_grad():
            model(*inputs)
    except RuntimeError as exc:
        raise InputValidationError(
            f"export_onnx example_inputs: the model fails on input '{name}' of shape {shape} (prepare had "
            f"{tuple(recorded)}): {exc}; {fix}"
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


def check_verify_batches(model: nn.Module, batches: Sequence[Sequence[Tensor]]) -> None:
    """Check every ``verify_onnx`` batch like :func:`check_export_inputs` checks dtypes, ranks and token ids.

    Raises:
        InputValidationError: naming the batch, the input and the fix.
    """
    for index, batch in enumerate(batches):
        check_model_inputs(model, batch, f"verify_onnx batch {index}")
