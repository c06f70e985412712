"""torch's exporter's table of ATen -> ONNX translations, built once per opset and process, not on every export.

Every ``torch.onnx.export(dynamo=True)`` starts with ``ONNXRegistry.from_torchlib(opset)``: it asks onnxscript for
its ~560 torchlib functions and infers an ONNX signature for each, 0.6 - 0.8 s on this machine, the same table each
time. One ``export_onnx`` is a small number of such exports, but ``auto_quantize`` exports every candidate, the sweep
one file per model, and on a small model the table is a fifth of the export (hf-vit: 0.76 s of 3.2 s).

:func:`torchlib_registry_reused` makes ``from_torchlib`` return a copy of the first table built for that opset in
this process for the duration of a ``with`` block. The copy is a new registry whose per-op lists are new lists of
the same (immutable after construction) translation records, so the custom translations an export registers
(``register_op`` inserts into those lists) stay in that export. The exported file is the same byte for byte
(``tests/onnx/test_torchlib_registry.py``). If torch no longer has the method, the block changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["torchlib_registry_reused"]

#: opset -> the registry torch built for it (never handed out: callers get copies).
_BUILT: dict[int, Any] = {}
_LOCK = threading.Lock()


def _copy(registry: Any) -> Any:
    fresh = type(registry)()
    fresh._opset_version = registry._opset_version  # noqa: SLF001 (the registry's own field, set as from_torchlib does)
    fresh.functions = {target: list(translations) for target, translations in registry.functions.items()}
    return fresh


@contextlib.contextmanager
def torchlib_registry_reused() -> Iterator[bool]:
    """Within the block, ``ONNXRegistry.from_torchlib(opset)`` builds each opset's table once and returns copies.

    Yields:
        True when the method was found and replaced for the block (False: torch changed, nothing is replaced).
    """
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:  # pragma: no cover (a torch without the dynamo exporter)
        yield False
        return
    registry_class = _registration.ONNXRegistry
    original = registry_class.__dict__.get("from_torchlib")
    if not isinstance(original, classmethod):
        yield False
        return
    build = original.__func__

    def from_torchlib(cls: type, opset_version: int = _registration._constants.TORCHLIB_OPSET) -> Any:  # noqa: SLF001
        with _LOCK:
            if opset_version not in _BUILT:
                _BUILT[opset_version] = build(cls, opset_version)
            return _copy(_BUILT[opset_version])

    registry_class.from_torchlib = classmethod(from_torchlib)
    try:
        yield True
    finally:
        registry_class.from_torchlib = original
