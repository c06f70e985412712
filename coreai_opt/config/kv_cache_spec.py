"""The spec of a quantized KV cache (``QuantizerConfig.kv_cache``): ``QuantizerConfig.presets.int8_kv_cache()``."""

from __future__ import annotations

from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.spec import PerAxes, QuantizationScheme, QuantizationSpec

__all__ = ["int8_kv_cache"]


@public_api
def int8_kv_cache() -> QuantizationSpec:
    """The spec of an int8 KV cache (``QuantizerConfig.kv_cache``): onnxruntime's per-channel quantized cache.

    Symmetric int8 over the full ``[-128, 127]`` (the range ``GroupQueryAttention`` saturates to), one calibrated
    scale per key / value head and channel (``PerAxes((1, 3))`` on ``(batch, kv_heads, sequence, head_dim)``:
    ``s = max |x| / 127.5`` over every calibration batch, ``global_minmax``: a decode step's one position must not
    replace the prompts' range), ``q = clamp(round(x / s), -128, 127)``. The cache takes a quarter of the float
    cache's memory; a value outside the calibrated range saturates.

    Example:
        >>> cfg = QuantizerConfig.presets.w4()
        >>> cfg.kv_cache = QuantizerConfig.presets.int8_kv_cache()
    """
    return QuantizationSpec(dtype="int8", qscheme=QuantizationScheme.SYMMETRIC, granularity=PerAxes((1, 3)),
                            qparams_calculator="global_minmax")
