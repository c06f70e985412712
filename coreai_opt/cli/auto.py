"""``quantize --auto [--max-error X]``: :func:`coreai_opt.auto_quantize` instead of one preset.

Per linear / convolution the format (static int8, dynamic int8, per-token int8 compute, int16 activations or float)
with the lowest estimated onnxruntime latency whose measured output error fits ``--max-error`` (relative squared
error on held-out calibration batches). Three files are written beside ``OUTPUT.onnx``:

* ``OUTPUT.auto.txt``: the per-layer table (choice, error, latency, alternatives) and the search rounds;
* ``OUTPUT.auto.json``: the same as JSON;
* ``OUTPUT.auto.yaml``: the chosen ``QuantizerConfig`` (it applies to the model after the SmoothQuant step
  ``auto_quantize`` runs first; ``co.auto_quantize(...).model`` is that model).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.usage_errors import CliError, one_line
from coreai_opt.onnx.export.save import write_text_atomically

if TYPE_CHECKING:
    from torch import fx, nn

__all__ = ["AutoOutcome", "auto_paths", "check_auto_options", "parse_max_error", "parse_max_latency", "run_auto",
           "write_auto_files"]

#: Options ``--auto`` replaces (it runs SmoothQuant and the calibration search itself).
_REPLACED = (("smoothquant", "--smoothquant"), ("search_calibration", "--search-calibration"),
             ("keep_float_top", "--keep-float-top"), ("config", "--config"))


@dataclass(frozen=True)
class AutoOutcome:
    """What the CLI needs from one ``auto_quantize`` run."""

    converted: fx.GraphModule
    model: nn.Module
    report: Any
    config: Any


def parse_max_error(text: str) -> float:
    """``--max-error`` value: a positive number (argparse ``type=``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive relative squared error such as 0.003, got {text!r}")
    return value


def parse_max_latency(text: str) -> float | str:
    """``--max-latency`` value: positive microseconds, or a format name (argparse ``type=``)."""
    from coreai_opt.api.algorithms.auto_quantize import CANDIDATES

    if text in CANDIDATES:
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected positive microseconds such as 1500 or a format name from "
                                         f"{', '.join(CANDIDATES)} (e.g. dynamic), got {text!r}")
    return value


def check_auto_options(args: argparse.Namespace) -> None:
    """Refuse ``--max-error`` / ``--max-latency`` without ``--auto`` and the options ``--auto`` replaces.

    Raises:
        CliError: naming the option and what to do instead.
    """
    if not args.auto:
        for value, flag in ((args.max_error, "--max-error"), (getattr(args, "max_latency", None), "--max-latency")):
            if value is not None:
                raise CliError(f"{flag} only applies with --auto; add --auto or drop {flag}")
        return
    for attr, flag in _REPLACED:
        if getattr(args, attr, None):
            raise CliError(f"--auto chooses the format per layer itself (SmoothQuant and the calibration search "
                           f"included); drop {flag}")


def run_auto(model: nn.Module, batches: list[tuple[Any, ...]], max_error: float | None, progress: bool,
             max_latency: float | str | None = None) -> AutoOutcome:
    """Run :func:`coreai_opt.auto_quantize` on the calibration batches (example inputs: the first batch)."""
    import coreai_opt as co

    try:  # neither bound given: auto_quantize's defaults (never estimated slower than every linear dynamic)
        result = co.auto_quantize(model, batches, batches[0], max_error=max_error, latency=max_latency,
                                  progress=progress)
    except ValueError as exc:
        raise CliError(f"--auto: {one_line(exc)}") from None
    if set(result.report.counts()) == {"float"}:
        raise CliError("--auto kept every layer float (" + "; ".join(result.report.notes) + "); there is nothing to "
                       "quantize at these layer sizes and this --max-error: raise --max-error or use --preset")
    return AutoOutcome(result.converted, result.model, result.report, result.config)


def auto_paths(output: Path) -> tuple[Path, Path, Path]:
    """``model.onnx`` -> (``model.auto.txt``, ``model.auto.json``, ``model.auto.yaml``)."""
    stem = output.with_suffix("")
    return tuple(stem.with_name(f"{stem.name}.auto.{ext}") for ext in ("txt", "json", "yaml"))


def write_auto_files(output: Path, outcome: AutoOutcome) -> tuple[Path, Path, Path]:
    """Write the three ``--auto`` files beside ``output`` (atomically)."""
    text, data, config = auto_paths(output)
    write_text_atomically(text, outcome.report.table())
    write_text_atomically(data, outcome.report.to_json() + "\n")
    write_text_atomically(config, outcome.config.to_yaml())
    return text, data, config
