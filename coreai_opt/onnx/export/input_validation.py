"""Checks at the start of ``export_onnx`` that go beyond :func:`~coreai_opt.api.internals.input_checks.check_inputs`.

The inputs themselves (count, dtype, rank, shape of a torch.export capture, empty tensors, token ids) are checked by
the one input check that ``calibrate`` and ``verify_onnx`` use too. Two checks are the exporter's own; both raise
:class:`~coreai_opt.errors.InputValidationError`:

* an FX-captured model whose example differs from the recorded one outside the batch dimension is run once, and a
  failure is reported with both shapes (instead of ``mat1 and mat2 shapes cannot be multiplied`` from the exporter);
* input and output names must differ (ONNX value names are unique; the onnx checker says ``Duplicate definition``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from coreai_opt.api.internals.input_checks import differing_shape, input_check
from coreai_opt.errors import InputValidationError

__all__ = ["check_export_inputs", "check_io_names"]

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
