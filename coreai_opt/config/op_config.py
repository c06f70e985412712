"""``OpConfig``: the weight and activation specs of one entry of a precedence level, each unset, None or a spec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from coreai_opt.config.coercion import check_keys, error_text, require_mapping, spec_from_value, spec_to_dict
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.spec import QuantizationSpec

__all__ = ["SPEC_FIELDS", "OpConfig", "op_config_from_value"]

#: The fields an entry sets (or leaves unset).
SPEC_FIELDS: tuple[str, ...] = ("weight", "activation")


class OpConfig(BaseModel):
    """Weight and activation specs for one entry of a precedence level.

    Each field is unset (inherit from the lower level), None (float) or a spec; see
    :mod:`coreai_opt.config.quantizer_config`.

    Args:
        weight: Spec for weights, None for float, or leave it out to inherit.
        activation: Spec for activations, None for float, or leave it out to inherit.

    Example:
        >>> OpConfig(activation=None).is_set("weight"), OpConfig(activation=None).is_set("activation")
        (False, True)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight: QuantizationSpec | None = None
    activation: QuantizationSpec | None = None

    @field_validator("weight", "activation", mode="before")
    @classmethod
    def _coerce_spec(cls, value: Any, info: Any) -> QuantizationSpec | None:
        return spec_from_value(value, f"OpConfig.{info.field_name}")

    @public_api
    def is_set(self, field: Literal["weight", "activation"]) -> bool:
        """Return True when ``field`` was given explicitly (as a spec or as None).

        Raises:
            ValueError: ``field`` is not ``"weight"`` or ``"activation"``.
        """
        if field not in SPEC_FIELDS:
            raise ValueError(f"OpConfig has no field {field!r}; use 'weight' or 'activation'")
        return field in self.model_fields_set

    @public_api
    def to_dict(self) -> dict[str, Any]:
        """Return a plain dict holding only the set fields (an unset field is absent, a float one is None)."""
        return {f: spec_to_dict(getattr(self, f)) for f in SPEC_FIELDS if self.is_set(f)}

    @classmethod
    @public_api
    def from_dict(cls, data: Mapping[str, Any]) -> OpConfig:
        """Build from :meth:`to_dict` output; absent keys stay unset.

        Raises:
            ValueError: Unknown key (named) or invalid spec.
            TypeError: ``data`` is not a dict.
        """
        data = require_mapping(data, "OpConfig")
        check_keys(data, SPEC_FIELDS, "OpConfig")
        return cls.model_validate(dict(data))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpConfig):
            return NotImplemented
        return self.model_fields_set == other.model_fields_set and all(
            getattr(self, f) == getattr(other, f) for f in SPEC_FIELDS
        )

    def __hash__(self) -> int:
        return hash((frozenset(self.model_fields_set), self.weight, self.activation))


def op_config_from_value(value: Any, where: str) -> OpConfig | None:
    """Accept an OpConfig, an :meth:`OpConfig.to_dict` dict or None (float); name ``where`` in any error."""
    if value is None or isinstance(value, OpConfig):
        return value
    if isinstance(value, Mapping):
        try:
            return OpConfig.from_dict(value)
        except TypeError as exc:
            raise TypeError(f"{where}: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"{where}: {error_text(exc)}") from exc
    raise TypeError(f"{where} must be an OpConfig, a dict or None (float); got {type(value).__name__}: {value!r}")
