r"""Greedy knapsack over (error, latency): the fastest assignment whose summed error stays within a budget.

Every unit ``u`` has options ``o`` with a measured error contribution ``e_{u,o}`` and an estimated latency
``t_{u,o}``. The search minimises ``Σ_u t_{u,o_u}`` subject to ``Σ_u e_{u,o_u} ≤ B``:

1. every unit starts at its fastest option (ties: lower error, then candidate order);
2. while ``Σ e > B``: apply the upgrade with the largest error saved per microsecond added,
   ``(e_{u,cur} − e_{u,o}) / max(t_{u,o} − t_{u,cur}, 10⁻⁹)``, over all units and options with a smaller error;
3. then, units in order of the latency they would save, take a faster option when ``Σ e`` stays within ``B``.

Ties break on unit order and candidate order, so the same inputs always give the same choices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coreai_opt.error_boundary import public_api

__all__ = ["Option", "greedy_assign"]


@dataclass(frozen=True)
class Option:
    """One candidate of one unit: its error contribution and latency (microseconds)."""

    error: float
    latency_us: float


def _fastest(options: Mapping[str, Option], order: Sequence[str]) -> str:
    return min(options, key=lambda c: (options[c].latency_us, options[c].error, order.index(c)))


@public_api
def greedy_assign(units: Sequence[Mapping[str, Option]], budget: float, order: Sequence[str]) -> list[str]:
    """Choose one option per unit (module docstring).

    Args:
        units: Per unit, candidate name -> :class:`Option` (only the applicable candidates).
        budget: ``B``, the largest allowed summed error.
        order: Every candidate name, in preference order for ties.

    Returns:
        The chosen candidate name per unit. When even the most accurate options exceed ``B`` they are all taken.

    Raises:
        ValueError: a unit has no option.

    Example:
        >>> units = [{"static": Option(0.5, 1.0), "float": Option(0.0, 4.0)},
        ...          {"static": Option(0.1, 1.0), "float": Option(0.0, 4.0)}]
        >>> greedy_assign(units, 0.2, ["static", "float"])
        ['float', 'static']
    """
    if any(not options for options in units):
        raise ValueError("every unit needs at least one candidate option")
    chosen = [_fastest(options, order) for options in units]
    total = sum(units[i][c].error for i, c in enumerate(chosen))
    while total > budget:
        best: tuple[float, int, int, str] | None = None
        for i, options in enumerate(units):
            current = options[chosen[i]]
            for c in sorted(options, key=order.index):
                o = options[c]
                if o.error >= current.error:
                    continue
                gain = (current.error - o.error) / max(o.latency_us - current.latency_us, 1e-9)
                key = (-gain, i, order.index(c), c)
                if best is None or key < best:
                    best = key
        if best is None:
            break
        _, i, _, c = best
        total += units[i][c].error - units[i][chosen[i]].error
        chosen[i] = c
    savings = []
    for i, options in enumerate(units):
        for c in options:
            saved = options[chosen[i]].latency_us - options[c].latency_us
            if saved > 0:
                savings.append((-saved, i, order.index(c), c))
    for _, i, _, c in sorted(savings):
        o, current = units[i][c], units[i][chosen[i]]
        if o.latency_us < current.latency_us and total - current.error + o.error <= budget:
            total += o.error - current.error
            chosen[i] = c
    return chosen
