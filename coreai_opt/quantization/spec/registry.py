"""A small named registry for pluggable families (range calculators, qparams calculators, fake-quantize).

One :class:`Registry` instance lives beside each family's base class. Specs name parts by key, and users
register their own subclasses the same way the built-ins are registered::

    @RANGE_CALCULATORS.register("my_range")
    class MyRange(RangeCalculatorBase): ...

    QuantizationSpec(dtype="int8", range_calculator="my_range")

A family's base class inherits :class:`RegistryFamily`, which gives it (and every subclass) the registry
classmethods ``register`` / ``get_class`` / ``resolve`` / ``list_registry_keys`` / ``list_registry_values``;
building the family's ``Registry`` with that base attaches the registry to it.

A spec names its parts by the field they fill (``range_calculator``, ``qparams_calculator``, ``fake_quantize``,
``weight_rounding``); :func:`family` answers which registry a field's keys come from. It imports the family's
built-in parts by module name on first use (:data:`BUILTIN_MODULES`), so the spec layer never imports the parts
that are built from specs and no import runs in a circle.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["BUILTIN_MODULES", "Registry", "RegistryFamily", "family"]

T = TypeVar("T", bound=type)

_KEY_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")

#: Spec field -> the module whose import registers that family's built-in parts.
BUILTIN_MODULES: dict[str, str] = {
    "range_calculator": "coreai_opt.quantization.ranges",
    "qparams_calculator": "coreai_opt.quantization.spec.builtin_qparams_calculators",
    "fake_quantize": "coreai_opt.quantization.fake_quantize",
    "weight_rounding": "coreai_opt.quantization.rounding",
}
_FAMILIES: dict[str, Registry] = {}


def family(field: str) -> Registry:
    """The registry whose keys a spec field names, with the family's built-in parts registered.

    Raises:
        KeyError: ``field`` is not one of :data:`BUILTIN_MODULES`.
    """
    importlib.import_module(BUILTIN_MODULES[field])  # cached after the first call
    return _FAMILIES[field]


class Registry(Generic[T]):
    """Map string keys to subclasses of one base class.

    Args:
        family: Human-readable family name used in error messages, e.g. ``"range calculator"``.
        base: Every registered class must subclass it.
    """

    def __init__(self, family: str, base: type, field: str | None = None) -> None:
        self.family = family
        self.base = base
        self._entries: dict[str, T] = {}
        if issubclass(base, RegistryFamily):
            base.family_registry = self
        if field is not None:
            _FAMILIES[field] = self

    def register(self, key: str) -> Callable[[T], T]:
        """Return a class decorator that registers the class under ``key``.

        Raises:
            ValueError: ``key`` is not snake_case or is already taken.
            TypeError: the decorated class does not subclass the family's base.
        """
        if not isinstance(key, str) or not _KEY_PATTERN.match(key):
            raise ValueError(
                f"{self.family} key {key!r} is invalid: use lower snake_case such as 'my_{self.family.split()[-1]}'"
            )

        def decorator(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"cannot register {cls!r} as a {self.family}: it must subclass {self.base.__name__}")
            existing = self._entries.get(key)
            if existing is not None and existing is not cls:
                raise ValueError(
                    f"{self.family} key {key!r} is already registered to {existing.__qualname__}; "
                    "choose another key or unregister the old one first"
                )
            self._entries[key] = cls
            cls.registry_key = key  # type: ignore[attr-defined]
            return cls

        return decorator

    def unregister(self, key: str) -> None:
        """Remove ``key`` (used by tests that register temporary classes)."""
        self.get_class(key)
        del self._entries[key]

    def get_class(self, key: str) -> T:
        """Return the class registered under ``key``.

        Raises:
            ValueError: unknown key; the message lists the known keys.
        """
        try:
            return self._entries[key]
        except KeyError:
            known = ", ".join(repr(k) for k in sorted(self._entries))
            raise ValueError(f"unknown {self.family} {key!r}; registered {self.family}s are: {known}") from None

    def resolve(self, data: str | type) -> T:
        """Resolve a key or a class to a registered class.

        A class is accepted when it subclasses the family's base (it need not be registered).
        """
        if isinstance(data, str):
            return self.get_class(data)
        if isinstance(data, type) and issubclass(data, self.base):
            return data  # type: ignore[return-value]
        raise TypeError(
            f"expected a {self.family} key (str) or a subclass of {self.base.__name__}, got {data!r}"
        )

    def key_of(self, cls: type) -> str:
        """Return the key a class is registered under.

        Raises:
            ValueError: the class is not registered.
        """
        for key, value in self._entries.items():
            if value is cls:
                return key
        raise ValueError(f"{cls.__qualname__} is not a registered {self.family}; register it with .register(key)")

    def list_registry_keys(self) -> list[str]:
        """Return the registered keys, sorted."""
        return sorted(self._entries)

    def list_registry_values(self) -> list[T]:
        """Return the registered classes, in key order."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, keys={self.list_registry_keys()})"


class RegistryFamily:
    """Mixin of a family's base class: the registry classmethods, all served by the family's one registry.

    ``Registry(family, Base)`` sets ``Base.family_registry``; subclasses inherit it, so
    ``MinMaxRangeCalculator.get_class("mse")`` and ``RangeCalculatorBase.get_class("mse")`` agree.
    """

    family_registry: ClassVar[Registry[Any]]

    @classmethod
    def register(cls, key: str) -> Callable[[type], type]:
        """Class decorator registering a class of this family under ``key``."""
        return cls.family_registry.register(key)

    @classmethod
    def get_class(cls, key: str) -> type:
        """Return the class of this family registered under ``key``."""
        return cls.family_registry.get_class(key)

    @classmethod
    def resolve(cls, data: str | type) -> type:
        """Resolve a key or a class of this family."""
        return cls.family_registry.resolve(data)

    @classmethod
    def list_registry_keys(cls) -> list[str]:
        """The family's registered keys, sorted."""
        return cls.family_registry.list_registry_keys()

    @classmethod
    def list_registry_values(cls) -> list[type]:
        """The family's registered classes, in key order."""
        return cls.family_registry.list_registry_values()
