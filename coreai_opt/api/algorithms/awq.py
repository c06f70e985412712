r"""``awq``: activation-aware weight scaling for weight-only (4-bit) quantization, before ``prepare``.

Weight-only quantization rounds every weight column ``j`` with the same relative precision, but the layer output
depends on column ``j`` through the activation channel ``X_j``: a column read by a loud channel matters more.
Activation-aware scaling (AWQ-style) scales the loud columns up before rounding and the activation down by the same
factor, so they get a finer grid. Per site (a tensor ``X`` read by linears ``y_i = X W_iᵀ``, the sites of
:mod:`coreai_opt.passes.smooth_linear_inputs`) and input channel ``j``::

    m_j = mean |X_j|                      over the calibration tokens
    s_j = m_j^α / sqrt(max_j m_j^α · min_j m_j^α)          (normalised so the scales straddle 1)
    X' = X / s,   W_i' = W_i · diag(s)    ⇒   X' W_i'ᵀ = X W_iᵀ   (exact in real arithmetic)

and ``α`` is chosen per site from :data:`AWQ_ALPHAS` (``α = 0`` is plain rounding, ``s = 1``) to minimise the
weight-only output error on up to ``max_tokens`` calibration tokens::

    E(α) = Σ_i ‖ X' Q(W_i')ᵀ − X W_iᵀ ‖²        Q = round to nearest in the weight spec (dtype, blocks, scheme)

The activation is not quantized here (weight-only). ``X / s`` is folded into the producer of ``X`` where the
site is foldable (LayerNorm, linear, attention value) and otherwise, with ``insert_mul=True`` (the default), applied
by one constant ``Mul`` on the path to the linears. Channels with ``m_j = 0`` keep ``s_j = 1``. The scaled model
is a float model with the same outputs (checked on the first batch); ``prepare`` it with the weight-only preset it
was scaled for, whose own rounding (GPTQ by default for ``w4``) then runs on the scaled weights::

    scaled = co.awq(model, calibration_batches, example_inputs)            # w4's weight spec by default
    prepared = co.prepare(scaled.model, co.QuantizerConfig.presets.w4(), example_inputs, capture="export")
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from coreai_opt.api.algorithms.scaling_checks import (
    ScaledModel,
    check_float_outputs_kept,
    keep_token_rows,
    site_cells,
)
from coreai_opt.api.internals.batches import as_call
from coreai_opt.config import QuantizerConfig
from coreai_opt.error_boundary import public_api
from coreai_opt.passes.capture import capture as capture_model
from coreai_opt.passes.smooth_linear_inputs import SmoothingSite, apply_smoothing, find_sites
from coreai_opt.quantization.rounding.weight_rounding import RTNRounding
from coreai_opt.quantization.spec import QuantizationSpec
from coreai_opt.quantization.spec.granularity import PerBlock, PerChannel

__all__ = ["AWQ_ALPHAS", "AwqResult", "AwqSiteReport", "awq", "awq_scale"]

#: Candidate strengths tried per site (0: no scaling).
AWQ_ALPHAS: tuple[float, ...] = tuple(i / 20 for i in range(21))


@dataclass(frozen=True)
class AwqSiteReport:
    """What happened at one site.

    Attributes:
        site: The site (tensor, consumers, kind, foldable).
        alpha: The chosen strength (None: left unscaled, because ``α = 0`` was best or the site is unusable).
        error_before: ``E(0)``, the rounding error of the site's linears without scaling, relative to
            ``Σ_i ‖X W_iᵀ‖²``.
        error_after: ``E(α)`` for the chosen ``α``, same normalisation (equal to ``error_before`` when unscaled).
    """

    site: SmoothingSite
    alpha: float | None
    error_before: float
    error_after: float


class AwqResult(ScaledModel[AwqSiteReport]):
    """The scaled float model and the per-site report: chosen ``α``, relative output error before → after."""

    columns = ("input of", "kind", "α", "relative error before → after")

    def _row(self, report: AwqSiteReport) -> list[str]:
        return [*site_cells(report.site, report.alpha), f"{report.error_before:.3g} → {report.error_after:.3g}"]


@public_api
def awq_scale(mean_abs: Tensor, alpha: float) -> Tensor:
    """``s_j = m_j^α / sqrt(max m^α · min m^α)`` over the channels with ``m_j > 0``; 1 elsewhere (float32)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    m = mean_abs.double()
    live = (m > 0) & torch.isfinite(m)
    if alpha == 0.0 or not bool(live.any()):
        return torch.ones_like(mean_abs, dtype=torch.float32)
    p = m[live].pow(alpha)
    s = torch.ones_like(m)
    s[live] = p / (p.max() * p.min()).sqrt()
    return s.float()


class _MeanAbsRecorder(fx.Interpreter):
    """Runs the graph and records, per site tensor, ``Σ|X_j|``, the token count and up to ``max_tokens`` rows."""

    def __init__(self, gm: fx.GraphModule, names: set[str], max_tokens: int) -> None:
        super().__init__(gm)
        self.names, self.max_tokens = names, max_tokens
        self.abs_sum: dict[str, Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.samples: dict[str, list[Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, Tensor):
            flat = out.detach().double().reshape(-1, out.shape[-1])
            total = flat.abs().sum(dim=0)
            self.abs_sum[n.name] = total if n.name not in self.abs_sum else self.abs_sum[n.name] + total
            self.tokens[n.name] = self.tokens.get(n.name, 0) + flat.shape[0]
            keep_token_rows(self.samples, n.name, flat.float(), self.max_tokens)
        return out

    def mean_abs(self, name: str) -> Tensor:
        """``mean |X_j|`` over every recorded token (float32)."""
        return (self.abs_sum[name] / self.tokens[name]).float()


def _weight_spec_for(spec: QuantizationSpec, weight: Tensor) -> QuantizationSpec:
    """The spec the weight is rounded with: per-block where the block divides the input channels.

    Elsewhere per-channel, as the ``w4`` preset's ``per_block_fallback`` does.
    """
    granularity = spec.granularity
    if isinstance(granularity, PerBlock) and weight.shape[1] % granularity.block_size:
        return spec.model_copy(update={"granularity": PerChannel(axis=0)})
    return spec


def _round_to_nearest(weight: Tensor, spec: QuantizationSpec) -> Tensor:
    spec = _weight_spec_for(spec, weight)
    rounded = RTNRounding(spec).round_weight(weight, None)
    granularity = spec.granularity
    q = rounded.q.float()
    return (q - granularity.expand(rounded.zero_point.float(), q)) * granularity.expand(rounded.scale, q)


def _site_error(x: Tensor, weights: list[Tensor], spec: QuantizationSpec, s: Tensor) -> float:
    """``Σ_i ‖(X/s) Q(W_i·diag(s))ᵀ − X W_iᵀ‖²`` (float64 sums)."""
    xs = x / s
    err = 0.0
    for w in weights:
        approx = xs @ _round_to_nearest(w * s.reshape(1, -1), spec).T
        err += float(((approx - x @ w.T).double() ** 2).sum())
    return err


def _default_weight_spec() -> QuantizationSpec:
    spec = QuantizerConfig.presets.w4().weight
    if spec is None:  # the preset always quantizes weights; guard the contract anyway
        raise RuntimeError("the w4 preset has no weight spec")
    return spec


def _check_spec(spec: QuantizationSpec) -> None:
    if not isinstance(spec, QuantizationSpec):
        raise TypeError(f"weight must be a QuantizationSpec (e.g. QuantizerConfig.presets.w4().weight), got "
                        f"{type(spec).__name__}")
    if spec.dtype_info.is_float or spec.dtype_info.bits > 8:
        raise ValueError(f"awq scales for integer weights of at most 8 bits, got {spec.dtype!r}; use an int4 / "
                         "uint4 / int8 / uint8 weight spec")


@public_api
def awq(
    model: nn.Module,
    data: Iterable[Any],
    example_inputs: tuple[Any, ...],
    *,
    weight: QuantizationSpec | None = None,
    alphas: tuple[float, ...] = AWQ_ALPHAS,
    example_kwargs: dict[str, Any] | None = None,
    insert_mul: bool = True,
    capture: str = "export",
    max_tokens: int = 1024,
    rtol: float = 1e-3,
) -> AwqResult:
    """Capture ``model``, measure its linear inputs on ``data`` and scale each site by its best ``α``.

    Args:
        model: The float model (not modified; a deep copy is captured).
        data: Calibration batches (tensor, tuple of positional inputs or dict of keyword inputs).
        example_inputs: Positional example inputs for capture (as for ``prepare``).
        weight: The weight spec the model will be quantized with (default: the ``w4`` preset's, int4 blocks of
            32, asymmetric); ``α`` is searched with round-to-nearest in this spec.
        alphas: Candidate strengths in ``[0, 1]``.
        example_kwargs: Keyword example inputs.
        insert_mul: Also scale non-foldable sites (a residual-branch LayerNorm output, a GELU output) with one
            constant ``Mul`` each; False scales foldable sites only (no new op).
        capture: ``"export"`` (default), ``"fx"`` or ``"auto"``.
        max_tokens: Tokens per site used to score the candidates.
        rtol: Allowed relative max difference between the float outputs before and after scaling.

    Returns:
        :class:`AwqResult`; pass ``result.model`` to ``prepare`` with the matching weight-only preset
        (``capture="export"``).

    Raises:
        ValueError: no data, a bad ``alphas`` / ``max_tokens``, a float weight spec, or no linear with a constant
            weight in the model.
        TypeError: ``weight`` is not a QuantizationSpec.
        RuntimeError: the scaled model's float outputs differ from the original's by more than ``rtol``.
    """
    spec = _default_weight_spec() if weight is None else weight
    _check_spec(spec)
    if not alphas or any(not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must be a non-empty tuple of floats in [0, 1], got {alphas!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int (e.g. 1024), got {max_tokens!r}")
    batches = list(data)
    if not batches:
        raise ValueError("awq needs at least one calibration batch")
    gm = capture_model(model, tuple(example_inputs), dict(example_kwargs or {}), method=capture)
    sites = find_sites(gm)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no linear layer with a constant weight; nothing to scale")
    recorder = _MeanAbsRecorder(gm, {s.tensor for s in sites}, max_tokens)
    with torch.no_grad():
        for batch in batches:
            args, kw = as_call(batch)
            recorder.run(*args, *kw.values())
        args, kw = as_call(batches[0])
        reference = torch.utils._pytree.tree_leaves(gm(*args, **kw))
        scales, reports = _choose_scales(gm, sites, recorder, spec, tuple(float(a) for a in alphas), insert_mul)
        apply_smoothing(gm, sites, scales, insert_mul=insert_mul)
        check_float_outputs_kept(reference, torch.utils._pytree.tree_leaves(gm(*args, **kw)), rtol,
                                 change="activation-aware scaling", workaround="pass insert_mul=False")
    return AwqResult(gm, tuple(reports))


def _choose_scales(
    gm: fx.GraphModule, sites: list[SmoothingSite], recorder: _MeanAbsRecorder, spec: QuantizationSpec,
    alphas: tuple[float, ...], insert_mul: bool,
) -> tuple[dict[str, Tensor], list[AwqSiteReport]]:
    scales: dict[str, Tensor] = {}
    reports: list[AwqSiteReport] = []
    for site in sites:
        weights = [operator.attrgetter(t)(gm).detach().float() for t in site.consumers]
        x = torch.cat(recorder.samples[site.tensor])
        norm = max(sum(float(((x @ w.T).double() ** 2).sum()) for w in weights), 1e-30)
        mean_abs = recorder.mean_abs(site.tensor)
        before = _site_error(x, weights, spec, torch.ones_like(mean_abs)) / norm
        best_alpha, best = None, before
        if site.foldable or insert_mul:
            for alpha in alphas:
                if alpha == 0.0:
                    continue
                err = _site_error(x, weights, spec, awq_scale(mean_abs, alpha)) / norm
                if err < best:
                    best_alpha, best = alpha, err
        if best_alpha is not None:
            scales[site.tensor] = awq_scale(mean_abs, best_alpha)
        reports.append(AwqSiteReport(site, best_alpha, before, best))
    return scales, reports
