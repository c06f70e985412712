r"""Quantization configs: :class:`QuantizerConfig` (precedence levels, YAML/dict I/O) and its presets.

Example:
    >>> from coreai_opt.config import OpConfig, QuantizerConfig
    >>> cfg = QuantizerConfig.presets.w8a8().set_module_name(r"head\..*", None)
"""

from __future__ import annotations

from coreai_opt.config import presets
from coreai_opt.config.level_keys import OP_KINDS
from coreai_opt.config.module_types import normalize_module_type
from coreai_opt.config.op_config import OpConfig
from coreai_opt.config.presets import PresetInfo, Presets
from coreai_opt.config.quantizer_config import UNSET, QuantizerConfig
from coreai_opt.config.resolution import ResolvedSpecs

__all__ = [
    "OP_KINDS",
    "UNSET",
    "OpConfig",
    "PresetInfo",
    "Presets",
    "QuantizerConfig",
    "ResolvedSpecs",
    "normalize_module_type",
    "presets",
]
