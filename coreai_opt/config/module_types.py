"""``module_type`` keys: resolving a class name without running code it does not already trust.

A config's ``module_type`` key is a class or its fully qualified name (``"torch.nn.Conv2d"``). A name resolves
among the modules **already imported** (``sys.modules``); only ``torch.nn`` and its submodules are imported when
missing. Importing any other module named in a YAML file would execute its top-level code, so such a key raises
:class:`~coreai_opt.errors.ConfigImportError` telling the user to import the module first or pass the class.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from coreai_opt.error_boundary import public_api
from coreai_opt.errors import ConfigImportError

__all__ = ["normalize_module_type", "qualified_name"]


def qualified_name(cls: type) -> str:
    """``cls.__module__ + "." + cls.__qualname__``, the canonical ``module_type`` key."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _may_import(module: str) -> bool:
    """Modules a config string may import: ``torch.nn`` and its submodules (torch's own code)."""
    return module == "torch.nn" or module.startswith("torch.nn.")


def _resolve_class(key: str) -> type | None:
    """Find ``"pkg.mod.Class"`` (or ``"pkg.mod.Outer.Inner"``) among the modules already imported.

    Nothing is imported except ``torch.nn.*``: importing a module named in a YAML file would run its top-level
    code. Returns None when an imported module has no such class.

    Raises:
        ConfigImportError: no prefix of ``key`` is an imported (or ``torch.nn``) module.
    """
    parts = key.split(".")
    not_imported: list[str] = []
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        module = sys.modules.get(module_name)
        if module is None and _may_import(module_name):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                module = None
        if module is None:
            not_imported.append(module_name)
            continue
        obj: Any = module
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj if isinstance(obj, type) else None
    if not_imported:
        candidates = " or ".join(repr(m) for m in not_imported)
        raise ConfigImportError(
            f"module_type key {key!r}: the module defining it ({candidates}) is not imported, and a config never "
            "imports modules itself (that would run their code). Import your module before building the config "
            f"(import {not_imported[-1]}), or pass the class itself: config.set_module_type(MyModule, ...)"
        )
    return None


@public_api
def normalize_module_type(key: type | str) -> str:
    """Return the canonical ``module_type`` key: the class's ``__module__ + "." + __qualname__``.

    Args:
        key: A ``torch.nn.Module`` subclass, or the fully qualified name of one. Names resolve among the
            modules already imported (``torch.nn.*`` is imported when needed; nothing else is, since importing
            runs a module's code): ``"torch.nn.Conv2d"`` -> ``"torch.nn.modules.conv.Conv2d"``.

    Raises:
        ConfigImportError: The module defining the class is not imported (a ``ValueError``; import it first or
            pass the class).
        ValueError: A string that does not name a class (short names like ``"Conv2d"`` included).
        TypeError: Neither a class nor a string, or a class that is not a ``torch.nn.Module`` subclass.
    """
    if isinstance(key, str):
        cls = _resolve_class(key) if "." in key else None
        if cls is None:
            raise ValueError(
                f"module_type key {key!r} does not name a class; use a fully qualified class name such as "
                "'torch.nn.Conv2d' or pass the class itself"
            )
    elif isinstance(key, type):
        cls = key
    else:
        raise TypeError(f"module_type key must be a class or a fully qualified class name, got {key!r}")
    if not issubclass(cls, torch.nn.Module):
        raise TypeError(f"module_type key {key!r} names {qualified_name(cls)}, which is not a torch.nn.Module")
    return qualified_name(cls)
