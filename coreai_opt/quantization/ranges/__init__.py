"""Range calculators: the statistics half of a quantizer.

Registry keys: ``minmax``, ``percentile``, ``mse``, ``entropy``.

:mod:`~coreai_opt.quantization.ranges.range_calculator` holds the family's base and ``minmax``; the histogram
calculators share :mod:`~coreai_opt.quantization.ranges.histogram_range_calculator` and the mergeable
:mod:`~coreai_opt.quantization.ranges.histogram`. Importing this package registers every built-in key.
"""

from __future__ import annotations

from coreai_opt.quantization.ranges.entropy_range_calculator import EntropyRangeCalculator
from coreai_opt.quantization.ranges.histogram import RowHistogram
from coreai_opt.quantization.ranges.histogram_range_calculator import HistogramRangeCalculatorBase
from coreai_opt.quantization.ranges.mse_range_calculator import MSERangeCalculator
from coreai_opt.quantization.ranges.percentile_range_calculator import PercentileRangeCalculator
from coreai_opt.quantization.ranges.range_calculator import (
    RANGE_CALCULATORS,
    MinMaxRangeCalculator,
    RangeCalculatorBase,
)

__all__ = [
    "EntropyRangeCalculator", "HistogramRangeCalculatorBase", "MSERangeCalculator", "MinMaxRangeCalculator",
    "PercentileRangeCalculator", "RANGE_CALCULATORS", "RangeCalculatorBase", "RowHistogram",
]
