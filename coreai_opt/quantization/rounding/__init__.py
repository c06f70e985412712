"""Weight rounding: how a weight quantizer turns a float weight into ``(integer weight, scale, zero point)``.

The family and its contract are :mod:`~coreai_opt.quantization.rounding.weight_rounding` (``rtn``); importing
this package registers every built-in algorithm: ``gptq`` / ``gptq_clip_search``
(:mod:`~coreai_opt.quantization.rounding.gptq`), ``hqq`` (:mod:`~coreai_opt.quantization.rounding.hqq`) and
``mse`` (:mod:`~coreai_opt.quantization.rounding.mse_clip_search`). The input statistics that data-aware
algorithms read are :mod:`~coreai_opt.quantization.rounding.input_statistics`.
"""

from __future__ import annotations

from coreai_opt.quantization.rounding.gptq import GPTQClipSearchRounding, GPTQRounding
from coreai_opt.quantization.rounding.hqq import HQQRounding
from coreai_opt.quantization.rounding.mse_clip_search import MSERounding
from coreai_opt.quantization.rounding.weight_rounding import WEIGHT_ROUNDING, RTNRounding, WeightRoundingBase

__all__ = [
    "WEIGHT_ROUNDING", "GPTQClipSearchRounding", "GPTQRounding", "HQQRounding", "MSERounding", "RTNRounding",
    "WeightRoundingBase",
]
