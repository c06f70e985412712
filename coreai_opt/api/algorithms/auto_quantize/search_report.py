"""What ``auto_quantize`` chose and why: one row per unit, the search rounds, printable as markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from coreai_opt.api.algorithms.auto_quantize.candidates import CANDIDATES
from coreai_opt.api.algorithms.auto_quantize.search import FrontPoint, Option, total
from coreai_opt.error_boundary import public_api

if TYPE_CHECKING:
    from coreai_opt.api.algorithms.auto_quantize.cost_table import CostTable
    from coreai_opt.api.algorithms.auto_quantize.units import Unit

__all__ = ["AutoQuantizeReport", "SearchRound", "UnitReport", "build_report"]


@dataclass(frozen=True)
class UnitReport:
    """One unit (layers reading one input tensor).

    Attributes:
        layers: Module names.
        kind: ``"linear"`` or ``"conv"``.
        choice: Chosen candidate.
        error: Error contribution of the choice (only this unit quantized), 0 for float.
        latency_us: Estimated onnxruntime latency of the unit's layers under the choice (cost table).
        alternatives: Every candidate tried -> ``(error contribution, latency_us)``.
        range_calculator: Activation range calculator of the calibrated candidates (``search_calibration``'s pick
            for the unit's input quantizer), None when the unit has none.
        smoothing_alpha: SmoothQuant migration strength applied to the unit's input (None: not smoothed).
    """

    layers: tuple[str, ...]
    kind: str
    choice: str
    error: float
    latency_us: float
    alternatives: dict[str, tuple[float, float]]
    range_calculator: str | None
    smoothing_alpha: float | None


@dataclass(frozen=True)
class SearchRound:
    """One greedy search and its check: the budget, the summed contributions and the measured error."""

    budget: float
    predicted_error: float
    measured_error: float
    latency_us: float


@dataclass(frozen=True)
class AutoQuantizeReport:
    """The whole decision.

    Attributes:
        units: One row per unit, in graph order.
        max_error: The requested bound.
        measured_error: End-to-end error of the returned model on the evaluation batches (``error_source``).
        error_source: Which batches the errors were measured on.
        metric: Name of the error metric.
        latency_us: Estimated latency of all linears / convolutions under the choices.
        reference_latency_us: The same estimate with every unit float, dynamic (where allowed) or static.
        cost_table: Key of the cost table (machine, onnxruntime version, threads).
        rounds: The search rounds, in order.
        seconds: Wall time of ``auto_quantize``.
        notes: Why the choices are what they are, in words.
        latency_bound_us: The latency bound ``L`` (None: none).
        front: The predicted (latency, error) trade-offs, fastest first (``search.latency_front``).
    """

    units: tuple[UnitReport, ...]
    max_error: float
    measured_error: float
    error_source: str
    metric: str
    latency_us: float
    reference_latency_us: dict[str, float]
    cost_table: str
    rounds: tuple[SearchRound, ...]
    seconds: float
    notes: tuple[str, ...] = ()
    latency_bound_us: float | None = None
    front: tuple[FrontPoint, ...] = ()

    @public_api
    def counts(self) -> dict[str, int]:
        """Number of layers per chosen candidate."""
        out: dict[str, int] = {}
        for u in self.units:
            out[u.choice] = out.get(u.choice, 0) + len(u.layers)
        return out

    @public_api
    def table(self) -> str:
        """Markdown: a summary line, the per-unit table and the notes."""
        names = sorted({c for u in self.units for c in u.alternatives})
        refs = ", ".join(f"all {k} {v / 1e3:.3f} ms" for k, v in self.reference_latency_us.items())
        bound = "" if self.latency_bound_us is None else f", bound {self.latency_bound_us / 1e3:.3f} ms"
        lines = [f"auto_quantize: measured error {self.measured_error:.3e} (max {self.max_error:.3e}, {self.metric}, "
                 f"{self.error_source}); estimated linear/conv latency {self.latency_us / 1e3:.3f} ms{bound} ({refs}); "
                 f"choices {self.counts()}; cost table {self.cost_table}; {self.seconds:.1f} s", "",
                 "| layers | kind | choice | error | latency µs | range | SQ α | "
                 + " | ".join(f"{n} err / µs" for n in names) + " |",
                 "|---|---|---|---:|---:|---|---:|" + "---|" * len(names)]
        for u in self.units:
            alts = " | ".join(f"{u.alternatives[n][0]:.2e} / {u.alternatives[n][1]:.0f}" if n in u.alternatives
                              else "—" for n in names)
            alpha = "—" if u.smoothing_alpha is None else f"{u.smoothing_alpha:g}"
            lines.append(f"| `{', '.join(u.layers)}` | {u.kind} | **{u.choice}** | {u.error:.2e} | "
                         f"{u.latency_us:.0f} | {u.range_calculator or '—'} | {alpha} | {alts} |")
        lines += ["", "| round | budget | predicted | measured | latency µs |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {i} | {r.budget:.3e} | {r.predicted_error:.3e} | {r.measured_error:.3e} | {r.latency_us:.0f} |"
                  for i, r in enumerate(self.rounds, 1)]
        if self.front:
            lines += ["", "| front: latency µs | predicted error | choices |", "|---:|---:|---|"]
            lines += [f"| {p.latency_us:.0f} | {p.predicted_error:.3e} | {_counts(p.choices)} |" for p in self.front]
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def __str__(self) -> str:
        return self.table()

    @public_api
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        data = asdict(self)
        data["units"] = [{**asdict(u), "layers": list(u.layers),
                          "alternatives": {k: list(v) for k, v in u.alternatives.items()}} for u in self.units]
        data["rounds"] = [asdict(r) for r in self.rounds]
        data["front"] = [{**asdict(p), "choices": list(p.choices)} for p in self.front]
        data["notes"] = list(self.notes)
        data["counts"] = self.counts()
        return data

    @public_api
    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=1)


def _counts(choices: Sequence[str]) -> str:
    return ", ".join(f"{c} ×{choices.count(c)}" for c in sorted(set(choices)))


def _notes(rows: Sequence[UnitReport], options: Sequence[dict[str, Option]], bounds: tuple[float, float | None],
           error: float, behind_static: tuple[str, ...], refused: dict[str, str]) -> list[str]:
    max_error, bound_us = bounds
    notes = [f"not measured: {c} (prepare refused it: {why})" for c, why in refused.items()]
    skipped = [c for c in CANDIDATES if c != "float" and not any(c in o for o in options) and c not in refused]
    if skipped:
        notes.append(f"not measured: {', '.join(skipped)} (not allowed, or its cost-table line is nowhere below "
                     "float's, so float, with zero error, is always at least as good)")
    if behind_static:
        notes.append(f"int8_compute dropped for {', '.join(behind_static)}: the input is a static layer's 8-bit "
                     "output, which MatMulNBits cannot read (the layer would run in float behind DequantizeLinear)")
    latency = total(options, [r.choice for r in rows]).latency_us
    if error > max_error and bound_us is not None and latency <= bound_us:
        notes.append(f"max_error {max_error:.3e} was not reached within the latency bound {bound_us / 1e3:.3f} ms: "
                     f"these are the most accurate choices within it (measured {error:.3e}); pass a larger latency= "
                     "(or latency=None with max_error=) to trade speed for accuracy (see the front)")
    elif error > max_error:
        notes.append(f"max_error {max_error:.3e} was not reached: the best measured error is {error:.3e}; "
                     "raise max_error or allow more candidates")
    floats = [r for r in rows if r.choice == "float"]
    fastest = [r for r in floats if all(r.latency_us <= lat for _, lat in r.alternatives.values())]
    if fastest:
        notes.append(f"kept float because float is the fastest kernel at their size: "
                     f"{', '.join(r.layers[0] + ('…' if len(r.layers) > 1 else '') for r in fastest)}")
    if len(floats) > len(fastest):
        notes.append(f"{len(floats) - len(fastest)} unit(s) kept float: the error of every faster format did not "
                     "fit the budget")
    return notes


def build_report(units: Sequence[Unit], choices: Sequence[str], options: Sequence[dict[str, Option]],
                 ranges: dict[str, str], alphas: dict[str, float], table: CostTable,
                 bounds: tuple[float, float | None], error: float, source: str, metric: str,
                 rounds: tuple[SearchRound, ...], seconds: float, behind_static: tuple[str, ...] = (),
                 refused: dict[str, str] | None = None, front: tuple[FrontPoint, ...] = ()) -> AutoQuantizeReport:
    """The report of one ``auto_quantize`` run; ``bounds`` = (max_error, latency bound in µs or None)."""
    rows = []
    for unit, choice, opts in zip(units, choices, options, strict=True):
        alpha = next((alphas[n] for n in unit.names if n in alphas), None)
        rows.append(UnitReport(unit.names, unit.kind, choice, opts[choice].error, opts[choice].latency_us,
                               {c: (o.error, o.latency_us) for c, o in opts.items()},
                               ranges.get(unit.label) if CANDIDATES[choice].calibrated else None, alpha))
    reference = {}
    for c in ("float", "dynamic", "static"):
        if all(c in o or "float" in o for o in options):
            reference[c] = sum((o[c] if c in o else o["float"]).latency_us for o in options)
    notes = _notes(rows, options, bounds, error, behind_static, refused or {})
    return AutoQuantizeReport(tuple(rows), bounds[0], error, source, metric, total(options, choices).latency_us,
                              reference, table.key, rounds, seconds, tuple(notes), bounds[1], front)
