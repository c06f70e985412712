"""The ``quantize`` tuning flags, each a thin call of the Python API on the same calibration batches.

* ``--smoothquant [ALPHA]``: :func:`coreai_opt.smooth_quant` before ``prepare`` (migrates activation outliers
  into the weights of the linears reading them; ``ALPHA`` in [0, 1] or ``search``, default 0.5).
* ``--search-calibration``: :func:`coreai_opt.search_calibration` after calibrating (per activation quantizer,
  the range calculator among minmax / percentile / mse / entropy with the smallest output error).
* ``--keep-float-top K``: :func:`coreai_opt.sensitivity` on a first calibrated copy, then
  :func:`coreai_opt.keep_sensitive` keeps the ``K`` layers with the largest output error in float, and the model
  is prepared and calibrated again with that config.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.usage_errors import CliError, one_line

if TYPE_CHECKING:
    from torch import fx, nn

__all__ = ["SENSITIVITY_BATCHES", "parse_alpha", "smooth", "keep_float_top", "search"]

#: Batches the sensitivity analysis runs (it runs them once per layer).
SENSITIVITY_BATCHES = 4


def parse_alpha(text: str) -> float | str:
    """``--smoothquant`` value: a float in [0, 1] or ``search`` (argparse ``type=``)."""
    if text == "search":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a migration strength in [0, 1] or 'search', got {text!r}")
    return value


def smooth(model: nn.Module, batches: list[tuple[Any, ...]], alpha: float | str) -> tuple[fx.GraphModule, str]:
    """SmoothQuant ``model``; returns the smoothed (captured) model and a one-line summary."""
    import coreai_opt as co

    try:
        result = co.smooth_quant(model, batches, batches[0], alpha=alpha)
    except ValueError as exc:
        raise CliError(f"--smoothquant: {one_line(exc)}") from None
    applied = [r for r in result.sites if r.applied]
    return result.model, f"alpha {alpha}, {len(applied)} of {len(result.sites)} linear-input sites smoothed"


def keep_float_top(model: nn.Module, config: Any, batches: list[tuple[Any, ...]], k: int, capture: str,
                   progress: bool) -> tuple[Any, list[str]]:
    """Measure per-layer sensitivity and return the config keeping the ``k`` worst layers float, plus their names."""
    import coreai_opt as co

    prepared = co.prepare(model, config, batches[0], capture=capture)
    co.calibrate(prepared, batches, progress=progress)
    report = co.sensitivity(prepared, batches[:SENSITIVITY_BATCHES])
    if k > len(report.rows):
        raise CliError(f"--keep-float-top {k}: the model has only {len(report.rows)} quantized conv/linear layers")
    return co.keep_sensitive(config, report, k), report.most_sensitive(k)


def search(prepared: fx.GraphModule, batches: list[tuple[Any, ...]]) -> dict[str, int]:
    """Pick the range calculator per activation quantizer; returns how many quantizers chose each."""
    import coreai_opt as co

    return co.search_calibration(prepared, batches).counts()
