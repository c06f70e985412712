"""Config values to and from plain data: specs from dicts, mapping and key checks, errors that name the field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

from pydantic import ValidationError

from coreai_opt.quantization.spec import QuantizationSpec

__all__ = ["check_keys", "error_text", "plain", "require_mapping", "spec_from_value", "spec_to_dict"]


def plain(value: Any) -> Any:
    """Convert tuples to lists and enums to their values, recursively, so the result is YAML/JSON-safe."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def error_text(exc: Exception) -> str:
    """One-line text of ``exc``; pydantic errors become ``"loc: msg; ..."`` (our own messages name their key)."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors(include_url=False):
        msg = err["msg"]
        if msg.startswith("Value error, "):
            parts.append(msg.removeprefix("Value error, "))
        else:
            loc = ".".join(str(p) for p in err["loc"])
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def spec_to_dict(spec: QuantizationSpec | None) -> dict[str, Any] | None:
    """The plain dict of ``spec`` (None for float)."""
    return None if spec is None else plain(spec.to_dict())


def spec_from_value(value: Any, where: str) -> QuantizationSpec | None:
    """Accept a spec, a spec dict or None; name ``where`` in any error."""
    if value is None or isinstance(value, QuantizationSpec):
        return value
    if isinstance(value, Mapping):
        try:
            return QuantizationSpec.from_dict(dict(value))
        except TypeError as exc:
            raise TypeError(f"{where}: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"{where}: {error_text(exc)}") from exc
    raise TypeError(
        f"{where} must be a QuantizationSpec, a dict accepted by QuantizationSpec.from_dict, or None (float); "
        f"got {type(value).__name__}: {value!r}"
    )


def check_keys(data: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Refuse a key of ``data`` outside ``valid``, naming it and the valid keys."""
    valid = tuple(valid)
    for key in data:
        if key not in valid:
            raise ValueError(f"{where} got unknown key {key!r}; valid keys: {', '.join(valid)}")


def require_mapping(data: Any, where: str) -> Mapping[str, Any]:
    """Return ``data`` when it is a mapping; otherwise raise a TypeError naming ``where``."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(data).__name__}: {data!r}")
    return data
