r"""Per-quantizer choice of the activation range calculator (minmax / percentile / mse / entropy).

For every static activation quantizer of a prepared model, each candidate range calculator observes the same
calibration tensors (one pass, streaming, bounded memory), its qparams are committed, and a second pass measures
the error it causes *at the output of the layers reading that tensor*::

    e_c = Σ_batches Σ_{linear L reading x} ‖(Q_c(x) − x) W_Lᵀ‖²        (x feeds linears)
    e_c = Σ_batches ‖Q_c(x) − x‖²                                     (otherwise)

The candidate with the smallest ``e_c`` replaces the quantizer (already calibrated). Dynamic quantizers and
quantizers with a fixed ``float_range`` (softmax / sigmoid outputs) are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx

from coreai_opt.api.internals.batches import as_call
from coreai_opt.api.internals.model_guard import exclusive_model
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.error_boundary import public_api
from coreai_opt.graph.graph_attrs import attr_value
from coreai_opt.graph.graph_meta import require_graph_meta
from coreai_opt.graph.linear_readers import linear_readers, linear_weight
from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.quantization.spec import FAKE_QUANTIZE, FakeQuantize

__all__ = ["CANDIDATES", "CalibrationChoice", "CalibrationSearchResult", "search_calibration"]

#: Candidate range calculator -> qparams calculator (histograms summarise every batch themselves).
CANDIDATES: dict[str, str] = {"minmax": "global_minmax", "percentile": "static", "mse": "static",
                              "entropy": "static"}


@dataclass(frozen=True)
class CalibrationChoice:
    """Result for one quantizer: the chosen calculator and every candidate's error."""

    quantizer: str
    chosen: str
    errors: dict[str, float]


@dataclass(frozen=True)
class CalibrationSearchResult:
    """All choices, in model order."""

    choices: tuple[CalibrationChoice, ...]

    @public_api
    def counts(self) -> dict[str, int]:
        """How many quantizers chose each calculator."""
        out: dict[str, int] = {}
        for c in self.choices:
            out[c.chosen] = out.get(c.chosen, 0) + 1
        return out

    @public_api
    def table(self) -> str:
        """Markdown table: quantizer, chosen calculator, error of each candidate relative to minmax."""
        names = list(CANDIDATES)
        lines = ["| quantizer | chosen | " + " | ".join(f"{n} err / minmax" for n in names) + " |",
                 "|---|---|" + "---:|" * len(names)]
        for c in self.choices:
            base = max(c.errors.get("minmax", 0.0), 1e-30)
            cells = " | ".join(f"{c.errors[n] / base:.3f}" if n in c.errors else "—" for n in names)
            lines.append(f"| `{c.quantizer}` | **{c.chosen}** | {cells} |")
        return "\n".join(lines)


def _consumer_weights(gm: fx.GraphModule) -> dict[str, list[Tensor]]:
    """Quantizer module name -> float weights of the linears that read its output."""
    out: dict[str, list[Tensor]] = {}
    for node in gm.graph.nodes:
        info = get_meta(node).quantizer
        if node.op != "call_module" or info is None or info.role is not Role.ACTIVATION:
            continue
        for linear in linear_readers(node, gm):
            weight = attr_value(gm, linear_weight(linear, gm).target)
            out.setdefault(str(node.target), []).append(weight.detach().float())
    return out


def _candidates(fq: FakeQuantize, names: Sequence[str]) -> dict[str, FakeQuantize]:
    out = {}
    for name in names:
        spec = fq.spec.model_copy(update={"range_calculator": name, "qparams_calculator": CANDIDATES[name]})
        cand = FAKE_QUANTIZE.get_class(spec.fake_quantize).from_spec(spec)
        cand.set_name(fq.name)
        cand.enable_observer(False)
        cand.enable_fake_quant(True)
        out[name] = cand
    return out


def _error(y: Tensor, x: Tensor, weights: list[Tensor]) -> float:
    """Output error of the linears reading ``y``.

    A shared quantizer is also called on tensors of other shapes (the source of a reshape group); only the
    weights whose input width matches apply, and without one the error is ``‖y − x‖²``.
    """
    d = (y - x).float()
    matching = [w for w in weights if w.shape[1] == d.shape[-1]]
    if not matching:
        return float((d**2).sum())
    flat = d.reshape(-1, d.shape[-1])
    return float(sum(((flat @ w.T) ** 2).sum() for w in matching))


@public_api
def search_calibration(prepared: fx.GraphModule, data: Iterable[Any], *,
                       candidates: Sequence[str] = tuple(CANDIDATES)) -> CalibrationSearchResult:
    """Pick the best range calculator per static activation quantizer and install it (in place).

    Args:
        prepared: A model from ``prepare`` (calibrated or not; its activation quantizers are replaced).
        data: Calibration batches (run twice).
        candidates: Subset of :data:`CANDIDATES`.

    Returns:
        :class:`CalibrationSearchResult` naming the calculator each quantizer got.

    Raises:
        TypeError: ``prepared`` was not produced by ``prepare``.
        ValueError: unknown candidate, no data, or a converted model.
    """
    if require_graph_meta(prepared, "search_calibration").converted:
        raise ValueError("search_calibration needs a prepared model, got a converted one; search before convert")
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown or not candidates:
        raise ValueError(f"unknown candidates {unknown}; choose from {list(CANDIDATES)}")
    batches = list(data)
    if not batches:
        raise ValueError("search_calibration needs at least one calibration batch")
    weights = _consumer_weights(prepared)
    activation_names = {str(n.target) for n in prepared.graph.nodes
                        if get_meta(n).quantizer is not None and get_meta(n).quantizer.role is Role.ACTIVATION}
    targets = {name: fq for name, fq in fake_quantizers(prepared)
               if name in activation_names and fq.stateful
               and fq.spec.float_range is None}
    cands = {name: _candidates(fq, candidates) for name, fq in targets.items()}
    errors: dict[str, dict[str, float]] = {name: dict.fromkeys(candidates, 0.0) for name in targets}
    saved = {name: bool(fq.fake_quant_enabled) for name, fq in targets.items()}
    phase = {"observe": True}

    def hook(name: str):  # noqa: ANN202
        def run(_module: FakeQuantize, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            for cname, cand in cands[name].items():
                if phase["observe"]:
                    cand.observe(x)
                else:
                    errors[name][cname] += _error(cand(x), x, weights.get(name, []))
        return run

    with exclusive_model(prepared, "search_calibration"):
        handles = [targets[name].register_forward_pre_hook(hook(name)) for name in targets]
        was_training = prepared.training
        prepared.eval()
        try:
            for fq in targets.values():
                fq.enable_fake_quant(False)  # candidates see float inputs, as calibration does
            with torch.no_grad():
                for batch in batches:
                    args, kwargs = as_call(batch)
                    prepared(*args, **kwargs)
                for group in cands.values():
                    for cand in group.values():
                        cand.commit()
                phase["observe"] = False
                for batch in batches:
                    args, kwargs = as_call(batch)
                    prepared(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            for name, fq in targets.items():
                fq.enable_fake_quant(saved[name])
            prepared.train(was_training)
    choices = []
    for name, fq in targets.items():
        best = min(errors[name], key=errors[name].get)
        winner = cands[name][best]
        winner.enable_fake_quant(saved[name])
        winner.enable_observer(bool(fq.observer_enabled))
        prepared.add_submodule(name, winner)
        choices.append(CalibrationChoice(fq.name, best, dict(errors[name])))
    return CalibrationSearchResult(tuple(choices))
