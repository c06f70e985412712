"""Which GPTQ Hessians ``calibrate`` accumulates in which pass over the data, so they fit a memory budget.

A linear of ``d`` input channels rounded by GPTQ accumulates one ``d × d`` float32 ``XᵀX`` during calibration:
``4·d²`` bytes. A decoder's Hessians together are about 1.1x its fp32 weights, so holding all of them next to
the model would exceed twice the weights (issue 20). ``calibrate`` therefore splits the Hessian statistics into
groups of at most :func:`hessian_budget` bytes (in module order; a single larger Hessian forms its own group),
runs the data once per group, and rounds (then frees) each group's weights before the next pass. Every
Hessian sums the same batches in the same order as in one pass, so the results are bit-identical; the other
statistics (activation ranges, second moments) are observed in the first pass only. When everything fits, there
is one pass, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from coreai_opt.api.internals.quantizer_state import weight_quantizer_inputs
from coreai_opt.quantization.rounding.input_statistics import InputStatistics

__all__ = ["hessian_budget", "hessian_groups", "check_reiterable", "HESSIAN_BUDGET_FRACTION", "HESSIAN_BUDGET_FLOOR"]

#: Default per-pass budget for the Hessians, as a fraction of the model's fp32 parameter bytes ...
HESSIAN_BUDGET_FRACTION = 0.25
#: ... and at least this many bytes (small models keep one pass, and one-shot iterators, as before).
HESSIAN_BUDGET_FLOOR = 256 * 2**20


def hessian_budget(prepared: fx.GraphModule, hessian_memory: int | None) -> int:
    """Bytes of Hessians one pass may hold: ``hessian_memory``, or a quarter of the fp32 parameter bytes (>= 256 MiB).

    Raises:
        ValueError: ``hessian_memory`` is not a positive int.
    """
    if hessian_memory is None:
        weights = sum(p.numel() * 4 for p in prepared.parameters())
        return max(HESSIAN_BUDGET_FLOOR, int(weights * HESSIAN_BUDGET_FRACTION))
    if isinstance(hessian_memory, bool) or not isinstance(hessian_memory, int) or hessian_memory < 1:
        raise ValueError(f"hessian_memory must be a positive number of bytes or None, got {hessian_memory!r}")
    return hessian_memory


def _hessian_bytes(prepared: fx.GraphModule) -> dict[InputStatistics, int]:
    """Each attached Hessian statistic with the bytes of its ``d × d`` float32 matrix (``d`` from its weight)."""
    sizes: dict[InputStatistics, int] = {}
    for fq, weight in weight_quantizer_inputs(prepared):
        stats = fq.rounding.statistics if fq.rounding is not None else None
        if stats is not None and stats.hessian and stats.attached and weight.dim() == 2:
            sizes[stats] = max(sizes.get(stats, 0), 4 * int(weight.shape[1]) ** 2)
    return sizes


def hessian_groups(
    prepared: fx.GraphModule, statistics: list[InputStatistics], budget: int
) -> list[list[InputStatistics]]:
    """Split ``statistics`` into per-pass groups; the first group also holds every non-Hessian statistic.

    Greedy in module order: a group closes when the next Hessian would push it over ``budget``.
    """
    sizes = _hessian_bytes(prepared)
    groups: list[list[InputStatistics]] = [[s for s in statistics if s not in sizes]]
    used = 0
    for stats in (s for s in statistics if s in sizes):
        if used and used + sizes[stats] > budget:
            groups.append([])
            used = 0
        groups[-1].append(stats)
        used += sizes[stats]
    return [g for g in groups if g] or [[]]


def check_reiterable(data: Iterable[object], groups: list[list[InputStatistics]], budget: int) -> None:
    """Refuse a one-shot iterator when the Hessians need more than one pass over the data.

    Raises:
        ValueError: ``data`` is its own iterator (a generator) and there are several groups (names the fix).
    """
    if len(groups) > 1 and iter(data) is data:
        raise ValueError(
            f"GPTQ's Hessians need {len(groups)} passes over the calibration data to stay within "
            f"hessian_memory={budget} bytes, but the data is a one-shot iterator ({type(data).__name__}); pass a "
            "re-iterable (a list of batches, a DataLoader) or a larger hessian_memory (all Hessians at once)"
        )
