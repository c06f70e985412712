"""The one rule on a histogram's size, checked where a spec is built and where a histogram is made."""

from __future__ import annotations

import math

__all__ = ["check_num_bins"]


def check_num_bins(num_bins: int) -> int:
    """Validate ``num_bins``: a power of two, at least 16.

    Raises:
        ValueError: naming the nearest valid values.
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 16 or num_bins & (num_bins - 1):
        lower = 2 ** max(4, int(math.log2(max(num_bins, 1))) if isinstance(num_bins, int) else 4)
        raise ValueError(
            f"num_bins={num_bins!r} must be a power of two >= 16 (the mergeable histogram grid halves exactly); "
            f"use e.g. num_bins={lower} or {lower * 2}"
        )
    return num_bins
