"""Accuracy-driven mixed precision: :func:`auto_quantize` picks a format per layer by error and latency.

One job per module: :mod:`.candidates` (the formats and their config entries), :mod:`.units` (layers grouped by
input tensor), :mod:`.output_error` (metric, held-out split, one-unit-at-a-time errors), :mod:`.cost_table` and
:mod:`.cost_measurement` (onnxruntime latency model, cached per machine), :mod:`.search` (greedy knapsacks: within
an error budget, within a latency bound, and the front), :mod:`.search_report` (what was chosen), :mod:`.recipe`
(the steps).
"""

from __future__ import annotations

from coreai_opt.api.algorithms.auto_quantize.candidates import CANDIDATES
from coreai_opt.api.algorithms.auto_quantize.cost_table import KERNEL_KINDS, CostTable, KernelCost
from coreai_opt.api.algorithms.auto_quantize.recipe import (
    DEFAULT_LATENCY,
    DEFAULT_MAX_ERROR,
    AutoQuantizeResult,
    auto_quantize,
)
from coreai_opt.api.algorithms.auto_quantize.search_report import AutoQuantizeReport

__all__ = ["CANDIDATES", "DEFAULT_LATENCY", "DEFAULT_MAX_ERROR", "KERNEL_KINDS", "AutoQuantizeReport",
           "AutoQuantizeResult", "CostTable", "KernelCost", "auto_quantize"]
