r"""Greedy knapsacks over (error, latency): fastest within an error budget, most accurate within a latency bound.

Every unit ``u`` has options ``o`` with a measured error contribution ``e_{u,o}`` and an estimated latency
``t_{u,o}``. :func:`greedy_assign` minimises ``Σ_u t_{u,o_u}`` subject to ``Σ_u e_{u,o_u} ≤ B``:

1. every unit starts at its fastest option (ties: lower error, then candidate order);
2. while ``Σ e > B``: apply the upgrade with the largest error saved per microsecond added,
   ``(e_{u,cur} − e_{u,o}) / max(t_{u,o} − t_{u,cur}, 10⁻⁹)``, over all units and options with a smaller error;
3. then, units in order of the latency they would save, take a faster option when ``Σ e`` stays within ``B``.

:func:`most_accurate_within` minimises ``Σ_u e_{u,o_u}`` subject to ``Σ_u t_{u,o_u} ≤ L``: from the fastest
options, it applies the upgrade with the largest error saved per microsecond added among those that still fit
``L``, until none fits. :func:`latency_front` runs it for a ladder of bounds from the fastest to the slowest
assignment: the predicted (latency, error) front between the two, which a ``latency=`` target picks from.

Ties break on unit order and candidate order, so the same inputs always give the same choices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coreai_opt.error_boundary import public_api

__all__ = ["FrontPoint", "Option", "greedy_assign", "latency_front", "most_accurate_within", "total"]


@dataclass(frozen=True)
class Option:
    """One candidate of one unit: its error contribution and latency (microseconds)."""

    error: float
    latency_us: float


@dataclass(frozen=True)
class FrontPoint:
    """One point of the predicted front: the most accurate choices within ``bound_us`` and their sums."""

    bound_us: float
    latency_us: float
    predicted_error: float
    choices: tuple[str, ...]


def total(units: Sequence[Mapping[str, Option]], chosen: Sequence[str]) -> Option:
    """The summed error and latency of one assignment."""
    return Option(sum(units[i][c].error for i, c in enumerate(chosen)),
                  sum(units[i][c].latency_us for i, c in enumerate(chosen)))


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
    error = total(units, chosen).error
    while error > budget and (upgrade := _best_upgrade(units, chosen, order, math.inf)) is not None:
        i, c = upgrade
        error += units[i][c].error - units[i][chosen[i]].error
        chosen[i] = c
    savings = []
    for i, options in enumerate(units):
        for c in options:
            saved = options[chosen[i]].latency_us - options[c].latency_us
            if saved > 0:
                savings.append((-saved, i, order.index(c), c))
    for _, i, _, c in sorted(savings):
        o, current = units[i][c], units[i][chosen[i]]
        if o.latency_us < current.latency_us and error - current.error + o.error <= budget:
            error += o.error - current.error
            chosen[i] = c
    return chosen


def _best_upgrade(units: Sequence[Mapping[str, Option]], chosen: Sequence[str], order: Sequence[str],
                  slack_us: float) -> tuple[int, str] | None:
    """The upgrade saving the most error per microsecond added whose added latency is at most ``slack_us``."""
    best: tuple[float, int, int, str] | None = None
    for i, options in enumerate(units):
        current = options[chosen[i]]
        for c in sorted(options, key=order.index):
            o = options[c]
            added = o.latency_us - current.latency_us
            if o.error >= current.error or added > slack_us:
                continue
            key = (-(current.error - o.error) / max(added, 1e-9), i, order.index(c), c)
            if best is None or key < best:
                best = key
    return None if best is None else (best[1], best[3])


@public_api
def most_accurate_within(units: Sequence[Mapping[str, Option]], bound_us: float, order: Sequence[str]) -> list[str]:
    """The assignment with the smallest summed error whose summed latency is at most ``bound_us`` (greedy).

    Args:
        units: Per unit, candidate name -> :class:`Option`.
        bound_us: ``L``, the largest allowed summed latency (microseconds).
        order: Every candidate name, in preference order for ties.

    Returns:
        The chosen candidate name per unit; the fastest options when even they exceed ``L``.

    Raises:
        ValueError: a unit has no option.

    Example:
        >>> units = [{"static": Option(0.5, 1.0), "float": Option(0.0, 4.0)},
        ...          {"static": Option(0.1, 1.0), "float": Option(0.0, 4.0)}]
        >>> most_accurate_within(units, 5.0, ["static", "float"])
        ['float', 'static']
    """
    if any(not options for options in units):
        raise ValueError("every unit needs at least one candidate option")
    chosen = [_fastest(options, order) for options in units]
    spent = total(units, chosen).latency_us
    while (upgrade := _best_upgrade(units, chosen, order, bound_us - spent)) is not None:
        i, c = upgrade
        spent += units[i][c].latency_us - units[i][chosen[i]].latency_us
        chosen[i] = c
    return chosen


@public_api
def latency_front(units: Sequence[Mapping[str, Option]], order: Sequence[str], steps: int = 8) -> list[FrontPoint]:
    """:func:`most_accurate_within` at ``steps`` bounds evenly spaced from the fastest to the slowest assignment.

    Points that repeat the previous point's choices are dropped, so every point is a different trade-off.
    """
    fastest = total(units, [_fastest(options, order) for options in units]).latency_us
    slowest = sum(max(o.latency_us for o in options.values()) for options in units)
    points: list[FrontPoint] = []
    for k in range(steps):
        bound = fastest + (slowest - fastest) * k / max(steps - 1, 1)
        chosen = tuple(most_accurate_within(units, bound, order))
        if points and points[-1].choices == chosen:
            continue
        sums = total(units, chosen)
        points.append(FrontPoint(bound, sums.latency_us, sums.error, chosen))
    return points
