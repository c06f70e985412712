r"""``auto_quantize``: choose static, dynamic, int8_compute, int16 or float per layer by error and onnxruntime latency.

Two targets, on the error ``E`` (``max_error``, default :data:`DEFAULT_MAX_ERROR`) and on the estimated latency of
the linears / convolutions ``L`` (``latency``: microseconds, or a candidate's name for "every layer in that format
where it applies, float elsewhere"). The answer is the fastest assignment whose measured error is ≤ ``E`` and whose
estimate is ≤ ``L``; when none is, the most accurate one within ``L``. By default (neither given) ``L`` is
``"dynamic"``: never slower than quantizing every linear dynamically, what onnxruntime's ``quantize_dynamic`` does;
an explicit ``max_error`` alone lifts the latency bound (the fastest assignment meeting it, float if need be). The
report's ``front`` lists the predicted trade-offs between the fastest and the slowest assignment.

The recipe (each step a public function)::

    smooth_quant(alpha="search", insert_mul=True)      outlier migration, kept per site where it lowers the error
    for each candidate c: prepare(every layer c) → calibrate → [search_calibration] → error of each unit alone
    latency of each unit under each c                  cost table (onnxruntime micro-benchmarks, cached)
    repeat ≤ 4 times: greedy_assign(budget), or most_accurate_within(L) when that is over L
                      → prepare(choices) → calibrate → measure the real error;
                      done when ≤ E or bound by L, else budget ·= 0.8 · E / measured
                      (an int8_compute unit that reads a static layer's 8-bit output runs no MatMulNBits: it loses
                      the option and the round is searched again)
    prepare(chosen config) → calibrate(all calibration batches) → convert

Only linears and convolutions are quantized (the other ops stay float), so the returned ``config`` is
``QuantizerConfig(weight=None, activation=None)`` plus one ``module_name`` entry per layer, and
``prepare(result.model, result.config, example_inputs)`` + ``calibrate(·, data)`` + ``convert`` rebuilds
``result.converted`` exactly. ``result.model`` is the float model after outlier migration (the input model when
nothing was smoothed).
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from coreai_opt.api.algorithms.auto_quantize.candidates import CANDIDATES, candidate_op_config, kernel_kind
from coreai_opt.api.algorithms.auto_quantize.cost_measurement import load_or_measure
from coreai_opt.api.algorithms.auto_quantize.cost_table import CostTable
from coreai_opt.api.algorithms.auto_quantize.output_error import (
    Metric,
    int8_compute_emulation,
    model_outputs,
    relative_squared_error,
    split_held_out,
    unit_errors,
)
from coreai_opt.api.algorithms.auto_quantize.search import (
    Option,
    greedy_assign,
    latency_front,
    most_accurate_within,
    total,
)
from coreai_opt.api.algorithms.auto_quantize.search_report import AutoQuantizeReport, SearchRound, build_report
from coreai_opt.api.algorithms.auto_quantize.units import Unit, find_units, layer_int8_compute
from coreai_opt.api.algorithms.calibration_search import search_calibration
from coreai_opt.api.algorithms.smooth_quant import smooth_quant
from coreai_opt.api.calibrate import calibrate
from coreai_opt.api.convert import convert
from coreai_opt.api.internals.renamed_keywords import renamed_keyword
from coreai_opt.api.prepare import prepare
from coreai_opt.config import QuantizerConfig
from coreai_opt.error_boundary import public_api

__all__ = ["DEFAULT_CANDIDATES", "DEFAULT_LATENCY", "DEFAULT_MAX_ERROR", "AutoQuantizeResult", "auto_quantize",
           "latency_bound"]

#: Default bound on the relative squared output error (≈ mean cosine 0.999 for normalised embeddings).
DEFAULT_MAX_ERROR = 2e-3
#: The latency bound when neither ``max_error`` nor ``latency`` is given: every linear dynamic (``quantize_dynamic``).
DEFAULT_LATENCY = "dynamic"
#: Candidates tried by default, in tie-break order.
DEFAULT_CANDIDATES: tuple[str, ...] = ("static", "dynamic", "int8_compute", "int16", "float")
#: The quantized candidates in measuring order: the first one measured defines the units (its input quantizers
#: group the readers of one tensor; an int8_compute model has none, so it goes last).
_MEASURING_ORDER: tuple[str, ...] = ("static", "dynamic", "int16", "int8_compute")
_MAX_ROUNDS = 4


@dataclass(frozen=True)
class AutoQuantizeResult:
    """What :func:`auto_quantize` returns.

    Attributes:
        converted: The converted model, ready for ``export_onnx``.
        config: The config that reproduces it from ``model`` (``to_yaml`` round-trips).
        model: The float model the config applies to (after outlier migration; a captured GraphModule when
            anything was smoothed, else the input model).
        capture: The ``capture`` argument ``prepare`` needs for ``model``.
        report: Per-unit choices, errors, latencies and alternatives.
    """

    converted: fx.GraphModule
    config: QuantizerConfig
    model: nn.Module
    capture: str
    report: AutoQuantizeReport


def _uniform_config(candidate: str) -> QuantizerConfig:
    config = QuantizerConfig(weight=None, activation=None)
    for kind in ("linear", "conv"):
        entry = candidate_op_config(candidate) if kind in CANDIDATES[candidate].layer_kinds else None
        config.set_op_kind(kind, entry)
    return config


def _build_config(units: Sequence[Unit], choices: Sequence[str], ranges: dict[str, str]) -> QuantizerConfig:
    config = QuantizerConfig(weight=None, activation=None)
    for unit, choice in zip(units, choices, strict=True):
        entry = candidate_op_config(choice, ranges.get(unit.label, "minmax") if choice == "static" else "minmax")
        for name in unit.names:
            config.set_module_name(re.escape(name), entry)
    return config


def _prepare(model: nn.Module, config: QuantizerConfig, example_inputs: tuple[Any, ...],
             example_kwargs: dict[str, Any] | None, capture: str) -> fx.GraphModule:
    with warnings.catch_warnings():  # a smoothed GraphModule re-captures with torch.export's own chatter
        warnings.filterwarnings("ignore", message=r".*(isinstance\(treespec|torch\.export|unused_module).*")
        # our own configs: a uniform one names both layer kinds (a transformer has no conv), and an all-float
        # choice quantizes nothing on purpose (the report says why)
        warnings.filterwarnings("ignore", message=r"op_kind key\(s\) \['(conv|linear)'\] match no op of ")
        warnings.filterwarnings("ignore", message=r"the config quantizes nothing in ")
        return prepare(model, config, example_inputs, example_kwargs=example_kwargs, capture=capture)


def _smooth(model: nn.Module, batches: list[Any], example_inputs: tuple[Any, ...],
            example_kwargs: dict[str, Any] | None) -> tuple[nn.Module, dict[str, float], str]:
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return model, {}, "auto"
    result = smooth_quant(model, batches, example_inputs, alpha="search", insert_mul=True,
                          example_kwargs=example_kwargs)
    alphas = {c.removesuffix(".weight"): r.alpha for r in result.sites if r.applied for c in r.site.consumers}
    if not alphas:
        return model, {}, "auto"
    return result.model, alphas, "export"


def _range_choices(prepared: fx.GraphModule, units: Sequence[Unit], batches: list[Any]) -> dict[str, str]:
    """Unit label -> range calculator ``search_calibration`` picked for the unit's input quantizer (in place)."""
    from coreai_opt.api.algorithms.auto_quantize.units import layer_quantizers

    chosen = {c.quantizer: c.chosen for c in search_calibration(prepared, batches).choices}
    by_layer = layer_quantizers(prepared)
    out = {}
    for unit in units:
        first = by_layer.get(unit.names[0], ())
        if first:
            name = getattr(prepared.get_submodule(first[0]), "name", first[0])
            if name in chosen:
                out[unit.label] = chosen[name]
    return out


def latency_bound(latency: float | str | None, units: Sequence[Unit], table: CostTable) -> float | None:
    """``L`` in microseconds: ``latency`` itself, or the cost-table estimate of every unit in the named format.

    A named format applies to the layer kinds it has (``"dynamic"``: linears), float to the others.
    """
    if latency is None or not isinstance(latency, str):
        return latency
    return sum(table.latency_us(kernel_kind(latency if unit.kind in CANDIDATES[latency].layer_kinds else "float",
                                            layer.kind), layer.macs) for unit in units for layer in unit.layers)


def _check(max_error: float, latency: float | str | None, candidates: Sequence[str], batches: list[Any]) -> None:
    if not (isinstance(max_error, (int, float)) and math.isfinite(max_error) and max_error > 0):
        raise ValueError(f"max_error must be a positive finite number (e.g. {DEFAULT_MAX_ERROR}), got {max_error!r}")
    number = isinstance(latency, (int, float)) and not isinstance(latency, bool)
    if not (latency is None or (number and math.isfinite(latency) and latency > 0) or latency in CANDIDATES):
        raise ValueError(f"latency must be None, a positive number of microseconds or a format name from "
                         f"{list(CANDIDATES)} (e.g. 'dynamic': no slower than every linear dynamic), got {latency!r}")
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown or not [c for c in candidates if c != "float"]:
        raise ValueError(f"candidates {list(candidates)} must be a subset of {list(CANDIDATES)} with at least one "
                         "quantized format (e.g. ('static', 'float'))")
    if not batches:
        raise ValueError("auto_quantize needs at least one calibration batch")


@renamed_keyword("calibration_data", "data")
@public_api
def auto_quantize(
    model: nn.Module,
    data: Iterable[Any],
    example_inputs: tuple[Any, ...],
    *,
    eval_data: Iterable[Any] | None = None,
    metric: Metric | None = None,
    max_error: float | None = None,
    latency: float | str | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    smooth: bool = True,
    cost_table: CostTable | None = None,
    example_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
) -> AutoQuantizeResult:
    """Pick a format per linear / conv: the fastest within ``max_error`` and ``latency`` (module docstring).

    Args:
        model: The float model (not modified), in eval mode.
        data: Calibration batches as for ``calibrate`` (``calibration_data=``, its old name, still works with a
            ``DeprecationWarning``); without ``eval_data`` every fourth batch is held out to
            measure errors (module docstring of :mod:`coreai_opt.api.algorithms.auto_quantize.output_error`).
        example_inputs: Positional example inputs (as for ``prepare``); latencies are estimated at their shape.
        eval_data: Batches to measure the errors on instead of the held-out split.
        metric: ``metric(outputs, references) -> float``; default relative squared error.
        max_error: Bound on the metric for the returned model; None: :data:`DEFAULT_MAX_ERROR`.
        latency: Bound on the estimated latency of the linears / convolutions: microseconds, or a format name
            (``"dynamic"``, ``"static"``, ``"float"``, ...: every layer in that format where it applies). None:
            :data:`DEFAULT_LATENCY` when ``max_error`` is None too, else no bound. Within the bound the most
            accurate choices win when ``max_error`` cannot be met (the report says so).
        candidates: Formats to choose from, a subset of
        :data:`~coreai_opt.api.algorithms.auto_quantize.candidates.CANDIDATES`.
        smooth: Migrate activation outliers into the weights first (SmoothQuant, α searched per site).
        cost_table: Latency table; default the cached measurement of this machine (1 onnxruntime thread).
        example_kwargs: Keyword example inputs.
        progress: Show a tqdm progress bar.

    Returns:
        :class:`AutoQuantizeResult` (``converted``, ``config``, ``model``, ``capture``, ``report``).

    Raises:
        ValueError: bad ``max_error`` / ``latency`` / ``candidates``, no calibration data, or no linear / conv to
            quantize.
    """
    start = time.perf_counter()
    batches = list(data)
    candidates = tuple(candidates)
    if latency is None and max_error is None:
        latency = DEFAULT_LATENCY
    max_error = DEFAULT_MAX_ERROR if max_error is None else max_error
    _check(max_error, latency, candidates, batches)
    if eval_data is None:
        calib, held = split_held_out(batches)
        source = (f"held-out calibration batches ({len(held)} of {len(batches)})" if held is not calib
                  else "the single calibration batch (pass eval_data for a held-out measurement)")
    else:
        calib, held, source = batches, list(eval_data), "eval_data"
        if not held:
            raise ValueError("eval_data is empty: pass at least one batch, or leave it None to hold out calibration "
                             "batches")
    metric_fn = metric or relative_squared_error
    table = cost_table if cost_table is not None else load_or_measure(threads=1)
    base, alphas, capture = _smooth(model, calib, example_inputs, example_kwargs) if smooth else (model, {}, "auto")

    measured = [c for c in _MEASURING_ORDER if c in candidates and _can_win(c, candidates, table)]
    if not measured:
        raise ValueError(f"no quantized candidate among {list(candidates)} is faster than float on any layer kind "
                         f"according to the cost table {table.key!r}; add 'static' or 'dynamic' to candidates")
    errors: dict[str, list[float | None]] = {}
    refused: dict[str, str] = {}
    ranges: dict[str, str] = {}
    units: list[Unit] = []
    references: list[torch.Tensor] = []
    bar = tqdm(total=None, disable=not progress, desc="auto_quantize", leave=False)
    try:
        for c in measured:
            try:
                prepared = _prepare(base, _uniform_config(c), example_inputs, example_kwargs, capture)
            except ValueError as refusal:  # MatMulNBits cannot hold some layer (e.g. a weight computed in forward)
                if c != "int8_compute" or not units:
                    raise
                refused[c] = str(refusal)
                bar.update(len(units))
                continue
            if not units:
                units = find_units(prepared)
                if not units:
                    raise ValueError(
                        f"{type(model).__name__} has no linear or convolution inside a named submodule: auto_quantize "
                        "configures layers by module name (a model that is itself one nn.Linear / nn.Conv has none; "
                        "wrap it, e.g. nn.Sequential(model))")
                bar.total = len(units) * len(measured) + _MAX_ROUNDS
                bar.refresh()
                from coreai_opt.api.qat import enable_fake_quant

                enable_fake_quant(prepared, False)
                with int8_compute_emulation(prepared):
                    references = model_outputs(prepared, held)
                enable_fake_quant(prepared, True)
            if CANDIDATES[c].calibrated:
                calibrate(prepared, calib, progress=False)
            if c == "static":
                ranges = _range_choices(prepared, units, calib)
            errors[c] = unit_errors(prepared, units, held, references, metric_fn, tick=bar.update)
        options = _options(units, candidates, errors, table)
        bound_us = latency_bound(latency, units, table)
        order = list(CANDIDATES)
        rounds: list[SearchRound] = []
        tried: list[tuple[list[str], fx.GraphModule, float]] = []
        budget = float(max_error)
        behind_static: list[int] = []
        for _ in range(_MAX_ROUNDS):
            choices, prepared, capped = _assign_and_prepare(options, (budget, bound_us), order, units, ranges,
                                                            behind_static, (base, example_inputs, example_kwargs,
                                                                            capture))
            predicted = sum(options[i][c].error for i, c in enumerate(choices))
            latency = sum(options[i][c].latency_us for i, c in enumerate(choices))
            calibrate(prepared, calib, progress=False)
            error = float(metric_fn(model_outputs(prepared, held), references))
            bar.update()
            rounds.append(SearchRound(budget, predicted, error, latency))
            tried.append((choices, prepared, error))
            if error <= max_error or capped or all(c == "float" for c in choices):
                break
            budget = min(budget * 0.5, 0.8 * budget * max_error / error) if predicted > 0 else budget * 0.5
    finally:
        bar.close()
    choices, prepared, error = min(tried, key=lambda t: (t[2] > max_error, total(options, t[0]).latency_us
                                                         if t[2] <= max_error else t[2]))
    config = _build_config(units, choices, ranges)
    if calib is not batches:  # the checked model saw only the calibration split: recalibrate on every batch
        prepared = _prepare(base, config, example_inputs, example_kwargs, capture)
        calibrate(prepared, batches, progress=False)
    converted = convert(prepared)
    report = build_report(units, choices, options, ranges, alphas, table, (max_error, bound_us), error, source,
                          getattr(metric_fn, "__name__", type(metric_fn).__name__), tuple(rounds),
                          time.perf_counter() - start, tuple(units[i].label for i in behind_static), refused,
                          tuple(latency_front(options, order)))
    return AutoQuantizeResult(converted, config, base, capture, report)


def _assign_and_prepare(options: list[dict[str, Option]], bounds: tuple[float, float | None], order: Sequence[str],
                        units: Sequence[Unit], ranges: dict[str, str], behind_static: list[int],
                        model_args: tuple[nn.Module, tuple[Any, ...], dict[str, Any] | None, str]
                        ) -> tuple[list[str], fx.GraphModule, bool]:
    """The search and ``prepare`` of its choices, until every int8_compute unit really runs ``MatMulNBits``.

    ``bounds`` = (error budget, latency bound or None): ``greedy_assign`` within the budget, replaced by
    ``most_accurate_within`` the latency bound when its choices are over it (then the third value is True).

    A linear whose input is already an 8-bit quantized tensor (a static layer's requantized output) gets no
    ``Int8ComputeActivation`` from ``prepare`` and runs as a float kernel behind ``DequantizeLinear``, neither
    the error nor the latency the search priced: such a unit loses its int8_compute option (appended to
    ``behind_static``, in place, with ``options``) and the assignment is searched again.
    """
    base, example_inputs, example_kwargs, capture = model_args
    budget, bound_us = bounds
    while True:
        choices = greedy_assign(options, budget, order)
        capped = bound_us is not None and total(options, choices).latency_us > bound_us
        if capped:
            choices = most_accurate_within(options, bound_us, order)
        prepared = _prepare(base, _build_config(units, choices, ranges), example_inputs, example_kwargs, capture)
        emulated = layer_int8_compute(prepared)
        blocked = [i for i, c in enumerate(choices)
                   if c == "int8_compute" and not all(name in emulated for name in units[i].names)]
        if not blocked:
            return choices, prepared, capped
        for i in blocked:
            del options[i]["int8_compute"]
            behind_static.append(i)


def _can_win(candidate: str, candidates: Sequence[str], table: CostTable) -> bool:
    """False when float is allowed and the candidate's line is nowhere below float's (float has zero error)."""
    if "float" not in candidates:
        return True
    for kind in CANDIDATES[candidate].layer_kinds:
        line, fp = table.kernels[kernel_kind(candidate, kind)], table.kernels[kernel_kind("float", kind)]
        if line.overhead_us < fp.overhead_us or line.macs_per_us > fp.macs_per_us:
            return True
    return False


def _options(units: Sequence[Unit], candidates: Sequence[str], errors: dict[str, list[float | None]],
             table: CostTable) -> list[dict[str, Option]]:
    out = []
    for i, unit in enumerate(units):
        options = {}
        for c in candidates:
            if unit.kind not in CANDIDATES[c].layer_kinds:
                continue
            error = 0.0 if c == "float" else errors.get(c, [None] * len(units))[i]
            if error is None:
                continue
            latency = sum(table.latency_us(kernel_kind(c, layer.kind), layer.macs) for layer in unit.layers)
            options[c] = Option(float(error), latency)
        out.append(options or {"float": Option(0.0, sum(table.latency_us(kernel_kind("float", layer.kind), layer.macs)
                                                        for layer in unit.layers))})
    return out
