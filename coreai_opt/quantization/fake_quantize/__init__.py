"""The modules a graph pass inserts next to a tensor: ``FakeQuantize`` and its bias and dynamic variants.

Registry keys (the ``fake_quantize`` field of a spec): ``default`` (:class:`FakeQuantize`), ``dynamic``
(:class:`DynamicFakeQuantize`); the int32 bias quantizer :class:`BiasFakeQuantize` is derived from its input's
and weight's quantizers (``s_b = s_in · s_w``), never observed. Importing this package registers every key.
"""

from __future__ import annotations

from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import DynamicFakeQuantize, dynamic_activation_spec
from coreai_opt.quantization.fake_quantize.fake_quantize import FAKE_QUANTIZE, FakeQuantize

__all__ = ["BiasFakeQuantize", "DynamicFakeQuantize", "FAKE_QUANTIZE", "FakeQuantize", "dynamic_activation_spec"]
