"""Specs and calculators: dtypes, granularities, ``QuantizationSpec``, the qparams calculators and the registry.

This is the seed library's public path: ``StatefulQParamsCalculatorBase`` and the other classes of the original
``coreai_opt.quantization.spec`` import from here. The parts built *from* a spec live in their own rooms beside
it and are handed on here by name, on first use, so that importing a spec never imports them (the qparams
calculators too, since each owns a range calculator):
range calculators (:mod:`coreai_opt.quantization.ranges`), ``FakeQuantize`` modules
(:mod:`coreai_opt.quantization.fake_quantize`) and the custom ops (:mod:`coreai_opt.quantization.ops`).
This layer knows nothing about graphs. See ``docs/ARCHITECTURE.md`` for the contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coreai_opt.lazy_exports import lazy_getattr
from coreai_opt.quantization.spec.dtypes import SUPPORTED_DTYPES, QuantDtype, get_dtype_info
from coreai_opt.quantization.spec.granularity import (
    Granularity,
    PerAxes,
    PerBlock,
    PerChannel,
    PerTensor,
    PerToken,
    QuantizationScheme,
    granularity_from_dict,
)
from coreai_opt.quantization.spec.qparams_math import SCALE_EPS, QParams, compute_qparams, quant_range
from coreai_opt.quantization.spec.registry import Registry
from coreai_opt.quantization.spec.spec import QuantizationSpec

if TYPE_CHECKING:
    from coreai_opt.quantization.fake_quantize import (
        FAKE_QUANTIZE,
        BiasFakeQuantize,
        DynamicFakeQuantize,
        FakeQuantize,
        dynamic_activation_spec,
    )
    from coreai_opt.quantization.ops.dynamic_quantize_op import (
        dynamic_quantize_dequantize,
        dynamic_quantize_dequantize_translation_table,
    )
    from coreai_opt.quantization.ops.quantize_dequantize_op import (
        SUPPORTED_OPSETS,
        quantize_dequantize,
        quantize_dequantize_translation_table,
    )
    from coreai_opt.quantization.ranges import (
        RANGE_CALCULATORS,
        EntropyRangeCalculator,
        HistogramRangeCalculatorBase,
        MinMaxRangeCalculator,
        MSERangeCalculator,
        PercentileRangeCalculator,
        RangeCalculatorBase,
        RowHistogram,
    )
    from coreai_opt.quantization.spec.builtin_qparams_calculators import (
        DynamicQParamsCalculator,
        GlobalMinMaxQParamsCalculator,
        MovingAverageQParamsCalculator,
        StaticQParamsCalculator,
    )
    from coreai_opt.quantization.spec.qparams_calculator import (
        QPARAMS_CALCULATORS,
        QParamsCalculatorBase,
        StatefulQParamsCalculatorBase,
        StatelessQParamsCalculatorBase,
    )

#: Names imported when first read (name -> defining module): the calculators, which own a range calculator, and
#: the parts built from specs in the rooms beside ``spec``. The modules imported above are leaves that those
#: parts import in turn, so importing any of them never runs this package's imports in a circle.
_HANDED_ON: dict[str, str] = {
    **dict.fromkeys(("QPARAMS_CALCULATORS", "QParamsCalculatorBase", "StatefulQParamsCalculatorBase",
                     "StatelessQParamsCalculatorBase"), "coreai_opt.quantization.spec.qparams_calculator"),
    **dict.fromkeys(("DynamicQParamsCalculator", "GlobalMinMaxQParamsCalculator", "MovingAverageQParamsCalculator",
                     "StaticQParamsCalculator"), "coreai_opt.quantization.spec.builtin_qparams_calculators"),
    **dict.fromkeys(("FAKE_QUANTIZE", "BiasFakeQuantize", "DynamicFakeQuantize", "FakeQuantize",
                     "dynamic_activation_spec"), "coreai_opt.quantization.fake_quantize"),
    **dict.fromkeys(("dynamic_quantize_dequantize", "dynamic_quantize_dequantize_translation_table"),
                    "coreai_opt.quantization.ops.dynamic_quantize_op"),
    **dict.fromkeys(("SUPPORTED_OPSETS", "quantize_dequantize", "quantize_dequantize_translation_table"),
                    "coreai_opt.quantization.ops.quantize_dequantize_op"),
    **dict.fromkeys(("RANGE_CALCULATORS", "EntropyRangeCalculator", "HistogramRangeCalculatorBase",
                     "MinMaxRangeCalculator", "MSERangeCalculator", "PercentileRangeCalculator",
                     "RangeCalculatorBase", "RowHistogram"), "coreai_opt.quantization.ranges"),
}


__getattr__ = lazy_getattr(__name__, globals(), _HANDED_ON)


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
    "PerAxes",
    "PerToken",
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
