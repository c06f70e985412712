"""The keys of the three override levels: op kinds, module classes and module-name regexes, checked and normalised.

Each level is a dict from key to :class:`~coreai_opt.config.op_config.OpConfig` (or None): ``op_kind`` keys are
:data:`OP_KINDS`, ``module_type`` keys are qualified class names (:func:`normalize_module_type`), ``module_name``
keys are regexes (``re.fullmatch``).
"""

from __future__ import annotations

import re
from typing import Any

from coreai_opt.config.coercion import require_mapping
from coreai_opt.config.module_types import normalize_module_type
from coreai_opt.config.op_config import OpConfig, op_config_from_value
from coreai_opt.graph.op_patterns import CONFIGURABLE_KINDS, SHARING_KINDS

__all__ = ["OP_KINDS", "normalize_level", "validate_op_kind", "validate_regex"]

#: The op kinds a config can target with ``op_kind``: every kind whose quantization pattern applies the config's
#: specs (derived from :data:`coreai_opt.graph.op_patterns.PATTERNS`, so the two cannot drift apart).
OP_KINDS: tuple[str, ...] = tuple(kind.value for kind in CONFIGURABLE_KINDS)
_SHARING_KINDS: tuple[str, ...] = tuple(kind.value for kind in SHARING_KINDS)


def validate_regex(pattern: Any) -> str:
    """Return ``pattern`` when it is a string that compiles as a regex."""
    if not isinstance(pattern, str):
        raise TypeError(f"module_name key must be a regex string, got {type(pattern).__name__}: {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"module_name key {pattern!r} is not a valid regex ({exc}); escape literal characters with re.escape"
        ) from exc
    return pattern


def validate_op_kind(kind: Any) -> str:
    """Return ``kind`` when it is in :data:`OP_KINDS`; an op that shares its input's quantizer is named as such."""
    if kind in _SHARING_KINDS:
        raise ValueError(
            f"op kind {kind!r} only moves values and shares its input's quantizer, so a config cannot set it; "
            "configure the op that produces its input instead"
        )
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r} in op_kind; valid op kinds: {', '.join(OP_KINDS)}")
    return kind


_KEY_NORMALIZERS = {
    "op_kind": validate_op_kind,
    "module_type": normalize_module_type,
    "module_name": validate_regex,
}


def normalize_level(level: str, value: Any) -> dict[str, OpConfig | None]:
    """Validate one level dict: normalise keys (later duplicates win, moved last) and coerce values."""
    mapping = require_mapping(value, level)
    out: dict[str, OpConfig | None] = {}
    for raw_key, entry in mapping.items():
        key = _KEY_NORMALIZERS[level](raw_key)
        out.pop(key, None)
        out[key] = op_config_from_value(entry, f"{level}[{key!r}]")
    return out
