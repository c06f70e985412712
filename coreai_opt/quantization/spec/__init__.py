"""Tensor-level quantization: dtypes, granularities, specs, calculators, the custom op and FakeQuantize.

This layer knows nothing about graphs. See ``docs/ARCHITECTURE.md`` for the contract.
"""

from __future__ import annotations

from coreai_opt.quantization.spec.bias_fake_quantize import BiasFakeQuantize
from coreai_opt.quantization.spec.dtypes import SUPPORTED_DTYPES, QuantDtype, get_dtype_info
from coreai_opt.quantization.spec.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from coreai_opt.quantization.spec.dynamic_quantize_op import (
    dynamic_quantize_dequantize,
    dynamic_quantize_dequantize_translation_table,
)
from coreai_opt.quantization.spec.entropy_range_calculator import EntropyRangeCalculator
from coreai_opt.quantization.spec.fake_quantize import FAKE_QUANTIZE, FakeQuantize
from coreai_opt.quantization.spec.granularity import (
    Granularity,
    PerBlock,
    PerChannel,
    PerTensor,
    QuantizationScheme,
    granularity_from_dict,
)
from coreai_opt.quantization.spec.histogram import RowHistogram
from coreai_opt.quantization.spec.histogram_range_calculator import HistogramRangeCalculatorBase
from coreai_opt.quantization.spec.mse_range_calculator import MSERangeCalculator
from coreai_opt.quantization.spec.percentile_range_calculator import PercentileRangeCalculator
from coreai_opt.quantization.spec.qparams_calculator import (
    QPARAMS_CALCULATORS,
    QParamsCalculatorBase,
    StatefulQParamsCalculatorBase,
    StatelessQParamsCalculatorBase,
)
from coreai_opt.quantization.spec.qparams_calculators import (
    DynamicQParamsCalculator,
    GlobalMinMaxQParamsCalculator,
    MovingAverageQParamsCalculator,
    StaticQParamsCalculator,
)
from coreai_opt.quantization.spec.qparams_math import SCALE_EPS, QParams, compute_qparams, quant_range
from coreai_opt.quantization.spec.quantize_dequantize_op import (
    SUPPORTED_OPSETS,
    quantize_dequantize,
    quantize_dequantize_translation_table,
)
from coreai_opt.quantization.spec.range_calculator import (
    RANGE_CALCULATORS,
    MinMaxRangeCalculator,
    RangeCalculatorBase,
)
from coreai_opt.quantization.spec.registry import Registry
from coreai_opt.quantization.spec.spec import QuantizationSpec

__all__ = [
    "BiasFakeQuantize",
    "DynamicFakeQuantize",
    "DynamicQParamsCalculator",
    "EntropyRangeCalculator",
    "FAKE_QUANTIZE",
    "FakeQuantize",
    "GlobalMinMaxQParamsCalculator",
    "Granularity",
    "HistogramRangeCalculatorBase",
    "MSERangeCalculator",
    "MinMaxRangeCalculator",
    "MovingAverageQParamsCalculator",
    "PerBlock",
    "PerChannel",
    "PerTensor",
    "PercentileRangeCalculator",
    "QPARAMS_CALCULATORS",
    "QParams",
    "QParamsCalculatorBase",
    "QuantDtype",
    "QuantizationScheme",
    "QuantizationSpec",
    "RANGE_CALCULATORS",
    "RangeCalculatorBase",
    "Registry",
    "RowHistogram",
    "SCALE_EPS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_OPSETS",
    "StatefulQParamsCalculatorBase",
    "StatelessQParamsCalculatorBase",
    "StaticQParamsCalculator",
    "compute_qparams",
    "dynamic_activation_spec",
    "dynamic_quantize_dequantize",
    "dynamic_quantize_dequantize_translation_table",
    "get_dtype_info",
    "granularity_from_dict",
    "quant_range",
    "quantize_dequantize",
    "quantize_dequantize_translation_table",
]
