r"""How a :class:`~coreai_opt.config.quantizer_config.QuantizerConfig` decides the specs of one op.

The entries that match the op are listed from the highest precedence level down (module name, module type, op
kind, global); for ``weight`` and for ``activation`` independently, the first entry that sets the field wins
(an entry of None sets both to float). Within ``module_name`` later patterns come first; within ``module_type``
the nearest class in the op's module's MRO.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Literal, NamedTuple, Protocol

from coreai_opt.config.module_types import qualified_name
from coreai_opt.config.op_config import OpConfig
from coreai_opt.quantization.spec import QuantizationSpec

__all__ = ["ConfigLevels", "ResolvedSpecs", "Resolver", "resolve_specs"]


class ConfigLevels(Protocol):
    """The levels of a :class:`~coreai_opt.config.quantizer_config.QuantizerConfig` that resolution reads."""

    weight: QuantizationSpec | None
    activation: QuantizationSpec | None
    module_name: Mapping[str, OpConfig | None]
    module_type: Mapping[str, OpConfig | None]
    op_kind: Mapping[str, OpConfig | None]


class ResolvedSpecs(NamedTuple):
    r"""What :meth:`QuantizerConfig.resolve` decided for one op.

    Attributes:
        weight: Spec for the op's weight, or None to keep it in float.
        activation: Spec for the op's activations, or None to keep them in float.
        source: Which entry decided, e.g. ``"module_name:'layer1\..*'"``,
            ``"module_type:torch.nn.modules.conv.Conv2d"``, ``"op_kind:conv"`` or ``"global"``. When weight and
            activation come from different entries: ``"weight from <source>; activation from <source>"``.
    """

    weight: QuantizationSpec | None
    activation: QuantizationSpec | None
    source: str



#: ``resolve(op_kind, module_name, module_type) -> ResolvedSpecs`` (``QuantizerConfig.resolve``), as passes take it.
Resolver = Callable[[str, "str | None", "type | None"], ResolvedSpecs]


def resolve_specs(
    config: ConfigLevels, op_kind: str, module_name: str | None, module_type: type | None
) -> ResolvedSpecs:
    """Decide the weight and activation specs of one op (the body of :meth:`QuantizerConfig.resolve`).

    Raises:
        TypeError: Arguments of the wrong type.
    """
    if not isinstance(op_kind, str):
        raise TypeError(f"resolve: op_kind must be a str, got {op_kind!r}")
    if isinstance(op_kind, Enum):  # the graph pass's str-valued OpKind
        op_kind = op_kind.value
    if module_name is not None and not isinstance(module_name, str):
        raise TypeError(f"resolve: module_name must be a str or None, got {module_name!r}")
    if module_type is not None and not isinstance(module_type, type):
        raise TypeError(f"resolve: module_type must be a class or None, got {module_type!r}")

    candidates: list[tuple[str, OpConfig | None]] = []
    if module_name is not None:
        for pattern, entry in reversed(config.module_name.items()):
            if re.fullmatch(pattern, module_name):
                candidates.append((f"module_name:'{pattern}'", entry))
    if module_type is not None:
        for cls in module_type.__mro__:
            key = qualified_name(cls)
            if key in config.module_type:
                candidates.append((f"module_type:{key}", config.module_type[key]))
    if op_kind in config.op_kind:
        candidates.append((f"op_kind:{op_kind}", config.op_kind[op_kind]))
    candidates.append(("global", OpConfig(weight=config.weight, activation=config.activation)))

    weight, weight_source = _pick(candidates, "weight")
    activation, activation_source = _pick(candidates, "activation")
    if weight_source == activation_source:
        source = weight_source
    else:
        source = f"weight from {weight_source}; activation from {activation_source}"
    return ResolvedSpecs(weight, activation, source)


def _pick(
    candidates: list[tuple[str, OpConfig | None]], field: Literal["weight", "activation"]
) -> tuple[QuantizationSpec | None, str]:
    for source, entry in candidates:
        if entry is None:
            return None, source
        if entry.is_set(field):
            return getattr(entry, field), source
    raise AssertionError("the global candidate always sets both fields")  # pragma: no cover
