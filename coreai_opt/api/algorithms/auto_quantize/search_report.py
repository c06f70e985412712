"""What ``auto_quantize`` chose and why: one row per unit, the search rounds, printable as markdown and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from coreai_opt.error_boundary import public_api

__all__ = ["AutoQuantizeReport", "SearchRound", "UnitReport"]


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
        lines = [f"auto_quantize: measured error {self.measured_error:.3e} (max {self.max_error:.3e}, {self.metric}, "
                 f"{self.error_source}); estimated linear/conv latency {self.latency_us / 1e3:.3f} ms ({refs}); "
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
        data["notes"] = list(self.notes)
        data["counts"] = self.counts()
        return data

    @public_api
    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=1)
