r"""``smooth_quant``: return a SmoothQuant-smoothed, captured copy of a float model, ready for ``prepare``.

Design: smoothing is a float-to-float model transformation that runs *before* ``prepare`` and is independent
of the quantization config, so it is a separate step rather than a config option::

    smoothed = co.smooth_quant(model, calibration_batches, example_inputs, alpha=0.5)
    prepared = co.prepare(smoothed.model, config, example_inputs, capture="export")

Per site (a tensor ``X`` read by linears, see :mod:`coreai_opt.passes.smooth_linear_inputs`) and input channel ``j``::

    s_j = max|X_j|^α / max|W_j|^(1−α)          X' = X / s,   W' = W · diag(s)

``max|X_j|`` is taken over every token of the calibration batches and ``max|W_j|`` over the output rows of all
linears reading ``X``; channels with ``max|X_j| = 0`` or ``max|W_j| = 0`` keep ``s_j = 1``. By default
``s_j ≥ 1`` (``min_scale=1``): channels are only ever shrunk. Plain SmoothQuant (``min_scale=0``) also *amplifies*
quiet channels whose weights are large; on MiniLM those become new activation outliers on unseen sentences
(measured: mean cosine 0.9916 at α = 0.5 without the floor, below the unsmoothed 0.9933; 0.9980 with it at
α = 0.75). ``alpha="search"``
picks, per site, the candidate among ``SEARCH_ALPHAS`` (or no smoothing) that minimises the site's output error

    ‖Q_a(X') Q_w(W')ᵀ − X Wᵀ‖²   on up to ``max_tokens`` calibration tokens per fold,

held out: the calibration batches are split in two folds (even / odd batches); scales fitted on one fold's
``max|X_j|`` are scored on the other fold's tokens and the two scores are summed (fitting and scoring on the same
tokens picks too large an α, whose scales do not generalise to new sentences).

with ``Q_a`` uint8 asymmetric per-tensor and ``Q_w`` int8 symmetric per-output-channel fake quantization (the
``w8a8`` / ``w8a8_dynamic`` activation and weight formats). Only foldable sites are smoothed unless
``insert_mul=True`` (then non-foldable sites get one constant ``Mul`` each, see the pass). The smoothed model's
float outputs are checked against the original's on the first batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from coreai_opt.api.algorithms.activation_stats import ChannelAbsMax
from coreai_opt.api.algorithms.scaling_checks import (
    ScaledModel,
    check_float_outputs_kept,
    keep_token_rows,
    site_cells,
)
from coreai_opt.api.internals.batches import as_call
from coreai_opt.error_boundary import public_api
from coreai_opt.graph.graph_attrs import attr_value
from coreai_opt.passes.capture import capture as capture_model
from coreai_opt.passes.smooth_linear_inputs import SmoothingSite, apply_smoothing, find_sites
from coreai_opt.quantization.spec import compute_qparams, get_dtype_info, quantize_dequantize

__all__ = ["SEARCH_ALPHAS", "SiteReport", "SmoothQuantResult", "smooth_quant", "smoothing_scale"]

#: Candidate migration strengths tried by ``alpha="search"`` (besides no smoothing).
SEARCH_ALPHAS: tuple[float, ...] = (0.25, 0.4, 0.5, 0.6, 0.75, 0.85)
_S_MIN, _S_MAX = 1e-5, 1e5


@dataclass(frozen=True)
class SiteReport:
    """What happened at one site.

    Attributes:
        site: The site (tensor, consumers, kind, producer parameters, reason).
        alpha: Migration strength used (None: left unsmoothed).
        applied: True when the scale was applied.
        act_ratio_before: ``max_j max|X_j| / median_j max|X_j|`` before smoothing.
        act_ratio_after: Same for ``X / s`` (equal to before when not applied).
    """

    site: SmoothingSite
    alpha: float | None
    applied: bool
    act_ratio_before: float
    act_ratio_after: float


class SmoothQuantResult(ScaledModel[SiteReport]):
    """The smoothed model and the per-site report: ``α``, applied or not, outlier ratio before → after."""

    columns = ("input of", "kind", "foldable", "α", "applied", "outlier ratio before → after")

    def _row(self, report: SiteReport) -> list[str]:
        consumers, kind, alpha = site_cells(report.site, report.alpha)
        return [consumers, kind, "yes" if report.site.foldable else "no", alpha, "yes" if report.applied else "no",
                f"{report.act_ratio_before:.1f} → {report.act_ratio_after:.1f}"]


@public_api
def smoothing_scale(x_absmax: Tensor, w_absmax: Tensor, alpha: float, min_scale: float = 1.0) -> Tensor:
    """``s_j = max|X_j|^α / max|W_j|^(1−α)``, clamped to ``[min_scale, 1e5]``; 1 where either maximum is 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (0.5 is the SmoothQuant default), got {alpha!r}")
    x, w = x_absmax.double(), w_absmax.double()
    s = x.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(max(min_scale, _S_MIN), _S_MAX).float()


class _Recorder(fx.Interpreter):
    """Runs the graph and records every site tensor per fold (batch index mod 2).

    Kept per fold: the per-channel abs-max and a token sample of up to ``max_tokens`` rows.
    """

    def __init__(self, gm: fx.GraphModule, names: set[str], max_tokens: int) -> None:
        super().__init__(gm)
        self.names, self.max_tokens = names, max_tokens
        self.fold = 0
        self.absmax = [ChannelAbsMax(), ChannelAbsMax()]
        self.samples: list[dict[str, list[Tensor]]] = [{}, {}]

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, Tensor):
            flat = self.absmax[self.fold].update(n.name, out)
            keep_token_rows(self.samples[self.fold], n.name, flat, self.max_tokens)
        return out

    def site_absmax(self, name: str, fold: int | None = None) -> Tensor:
        """Abs-max over one fold, or over both (``fold=None``; a fold without batches is skipped)."""
        folds = [self.absmax[f].values[name] for f in ((0, 1) if fold is None else (fold,))
                 if name in self.absmax[f].values]
        return torch.stack(folds).amax(dim=0)


def _fake_quant(x: Tensor, dtype: str, scheme: str, per_row: bool) -> Tensor:
    info = get_dtype_info(dtype)
    if per_row:
        mn, mx = x.amin(dim=1), x.amax(dim=1)
    else:
        mn, mx = x.min(), x.max()
    q = compute_qparams(mn, mx, info, scheme)
    return quantize_dequantize(x.contiguous(), q.scale, q.zero_point, int(info.quant_min), int(info.quant_max),
                               0, 0, dtype)


def _site_error(x: Tensor, weights: list[Tensor], s: Tensor | None) -> float:
    ref = [x @ w.T for w in weights]
    xs = x if s is None else x / s
    xq = _fake_quant(xs, "uint8", "asymmetric", per_row=False)
    err = 0.0
    for w, r in zip(weights, ref, strict=True):
        ws = w if s is None else w * s.reshape(1, -1)
        err += float(((xq @ _fake_quant(ws, "int8", "symmetric", per_row=True).T - r) ** 2).sum())
    return err


def _search_alpha(recorder: _Recorder, name: str, weights: list[Tensor], w_absmax: Tensor, min_scale: float
                  ) -> float | None:
    """Two-fold held-out choice: scales from one fold's abs-max, error on the other fold's tokens, summed."""
    folds = [f for f in (0, 1) if recorder.samples[f].get(name)]
    pairs = [(f, 1 - f) for f in folds] if len(folds) == 2 else [(folds[0], folds[0])]
    samples = {f: torch.cat(recorder.samples[f][name]) for f in folds}
    best, chosen = sum(_site_error(samples[test], weights, None) for _, test in pairs), None
    for a in SEARCH_ALPHAS:
        err = sum(_site_error(samples[test], weights,
                              smoothing_scale(recorder.site_absmax(name, fit), w_absmax, a, min_scale))
                  for fit, test in pairs)
        if err < best:
            best, chosen = err, a
    return chosen


def _ratio(amax: Tensor) -> float:
    return float(amax.max()) / max(float(amax.median()), 1e-12)


@public_api
def smooth_quant(
    model: nn.Module,
    data: Iterable[Any],
    example_inputs: tuple[Any, ...],
    *,
    alpha: float | str = 0.5,
    example_kwargs: dict[str, Any] | None = None,
    insert_mul: bool = False,
    capture: str = "export",
    max_tokens: int = 1024,
    min_scale: float = 1.0,
    rtol: float = 1e-3,
) -> SmoothQuantResult:
    """Capture ``model``, measure its linear inputs on ``data`` and smooth every site that can be smoothed.

    Args:
        model: The float model (not modified; a deep copy is captured).
        data: Calibration batches (tensor, tuple of positional inputs or dict of keyword inputs).
        example_inputs: Positional example inputs for capture (as for ``prepare``).
        alpha: Migration strength in ``[0, 1]`` or ``"search"`` (per site, see the module docstring).
        example_kwargs: Keyword example inputs.
        insert_mul: Also smooth non-foldable sites with an inserted constant ``Mul`` (adds one op per site).
        capture: ``"export"`` (default), ``"fx"`` or ``"auto"``.
        max_tokens: Tokens per site and fold kept for ``alpha="search"``.
        min_scale: Lower bound of every ``s_j`` (1: never amplify a channel; 0: plain SmoothQuant).
        rtol: Allowed relative max difference between the float outputs before and after smoothing.

    Returns:
        :class:`SmoothQuantResult`; pass ``result.model`` to ``prepare`` (``capture="export"``).

    Raises:
        ValueError: bad ``alpha``, no data, or no linear with a constant weight in the model.
        RuntimeError: the smoothed model's float outputs differ from the original's by more than ``rtol``
            (a site was misclassified; the message names the largest difference).
    """
    if not (alpha == "search" or (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0)):
        raise ValueError(f"alpha must be a float in [0, 1] or 'search', got {alpha!r}")
    batches = list(data)
    if not batches:
        raise ValueError("smooth_quant needs at least one calibration batch")
    kwargs = dict(example_kwargs or {})
    gm = capture_model(model, tuple(example_inputs), kwargs, method=capture)
    sites = find_sites(gm)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no linear layer with a constant weight; nothing to smooth")
    recorder = _Recorder(gm, {s.tensor for s in sites}, max_tokens if alpha == "search" else 0)
    with torch.no_grad():
        for index, batch in enumerate(batches):
            args, kw = as_call(batch)
            recorder.fold = index % 2
            recorder.run(*args, *kw.values())
        args, kw = as_call(batches[0])
        reference = torch.utils._pytree.tree_leaves(gm(*args, **kw))
    scales: dict[str, Tensor] = {}
    reports: list[SiteReport] = []
    for site in sites:
        amax = recorder.site_absmax(site.tensor)
        weights = [attr_value(gm, t).detach().float() for t in site.consumers]
        w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
        usable = site.foldable or insert_mul
        chosen: float | None = float(alpha) if alpha != "search" else None
        if alpha == "search" and usable:
            chosen = _search_alpha(recorder, site.tensor, weights, w_absmax, min_scale)
        applied = usable and chosen is not None
        after = amax
        if applied:
            scales[site.tensor] = smoothing_scale(amax, w_absmax, chosen, min_scale)
            after = amax / scales[site.tensor]
        reports.append(SiteReport(site, chosen if applied else None, applied, _ratio(amax), _ratio(after)))
    apply_smoothing(gm, sites, scales, insert_mul=insert_mul)
    with torch.no_grad():
        smoothed = torch.utils._pytree.tree_leaves(gm(*args, **kw))
    check_float_outputs_kept(reference, smoothed, rtol, change="smoothing",
                             workaround="pass insert_mul=False and alpha=0 for it")
    return SmoothQuantResult(gm, tuple(reports))
