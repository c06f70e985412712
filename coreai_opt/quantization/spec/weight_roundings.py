"""The built-in weight-rounding algorithms, imported together so that every key is registered.

See :mod:`~coreai_opt.quantization.spec.weight_rounding` for the family and its contract.
"""

from __future__ import annotations

from coreai_opt.quantization.spec.rounding_gptq import GPTQClipSearchRounding, GPTQRounding
from coreai_opt.quantization.spec.rounding_hqq import HQQRounding
from coreai_opt.quantization.spec.rounding_mse import MSERounding
from coreai_opt.quantization.spec.weight_rounding import WEIGHT_ROUNDING, RTNRounding, WeightRoundingBase

__all__ = [
    "WEIGHT_ROUNDING", "GPTQClipSearchRounding", "GPTQRounding", "HQQRounding", "MSERounding", "RTNRounding",
    "WeightRoundingBase",
]
