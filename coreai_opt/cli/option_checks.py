"""Checks of ``quantize`` options that run before any calibration work, with CLI wording in every message.

* the output path: not a directory, and its folder exists or can be created and is writable (also for the two
  report files beside it);
* ``--opset``: right after ``prepare`` (before calibrating), against the range the exporter writes and what
  this model needs: the dtypes' lowest opset (int4 / int16 / per-block: 21, float8: 19) and the opset in which
  its ops export best (GELU: 20). Every message names this model's default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from coreai_opt.cli.console import Console
from coreai_opt.cli.quantize_report import report_paths
from coreai_opt.cli.usage_errors import CliError

if TYPE_CHECKING:
    from torch import fx

__all__ = ["check_output_path", "check_opset_for_model"]


def check_output_path(output: Path) -> None:
    """Refuse an output that cannot be written, before any work.

    Raises:
        CliError: ``output`` (or a report path beside it) is a directory, or its nearest existing folder is not
            a writable directory.
    """
    for path in (output, *report_paths(output)):
        if path.is_dir() and not path.is_symlink():
            raise CliError(f"output path {path} is a directory; pass a file path such as {path / 'model.onnx'}")
    folder = output.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise CliError(f"cannot create {output.parent}: {folder} is a file, not a directory; pick another -o path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"cannot write to {folder} (permission denied); pick another -o path")


def check_opset_for_model(opset: int | None, prepared: fx.GraphModule, console: Console) -> int:
    """Return the opset the export will use, or refuse an ``--opset`` this model cannot be written with.

    Raises:
        CliError: ``--opset`` is outside the exporter's range or below what a quantizer's dtype or granularity
            needs (the message names it and the opset to pass).
    """
    from coreai_opt.onnx.export.model_quantizers import quantizer_uses
    from coreai_opt.onnx.export.opset import (
        GELU_OPSET,
        MAX_OPSET,
        MIN_OPSET,
        preferred_opset,
        required_opset,
        select_opset,
    )
    from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
    from coreai_opt.quantization.spec import FakeQuantize

    quantizers = [m for m in prepared.modules() if isinstance(m, (FakeQuantize, BiasFakeQuantize))]
    uses = quantizer_uses(quantizers)
    preferred = preferred_opset(prepared)
    default = select_opset(uses, None, preferred=preferred)
    if opset is None:
        return default
    if not MIN_OPSET <= opset <= MAX_OPSET:
        why = " (its GELU exports as one Gelu op from 20)" if preferred > MIN_OPSET and default == preferred else ""
        raise CliError(f"--opset {opset} is not supported: coreai-opt writes opsets {MIN_OPSET} to {MAX_OPSET}, and "
                       f"this model exports best with {default}{why}; pass --opset {default} or leave --opset out")
    needed = {use: required_opset(use) for use in uses}
    too_low = [use for use in uses if needed[use] > opset]
    if too_low:
        worst = max(too_low, key=needed.get)
        what = f"{worst.dtype} {f'{worst.granularity} ' if worst.blocked else ''}quantizer {worst.name!r}"
        raise CliError(f"--opset {opset} is too low for this model: its {what} needs opset {needed[worst]}; "
                       f"pass --opset {max(needed.values())} or leave --opset out (then {default} is used)")
    if opset < preferred:
        console.warn(f"--opset {opset} writes this model's GELU as Erf/Div/Add/Mul, which onnxruntime cannot fuse "
                     f"back between Q/DQ nodes; opset {GELU_OPSET} (the default here) keeps it one Gelu op")
    return opset
