"""Let ``timm`` import beside torch 2.13.0+cpu: declare torchvision's ``nms`` / ``qnms`` op schemas when its C++ ops
do not load.

The only torchvision 0.28.0 wheel is a CUDA build whose ``_C.so`` does not load beside the CPU torch, and then
``import torchvision`` (which timm does) fails with ``RuntimeError: operator torchvision::nms does not exist``: its
fake-tensor registrations need the schemas. Models that never call a torchvision op run fine once the two schemas
exist. This is test and benchmark setup only; the library never imports torchvision.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

__all__ = ["declare_torchvision_ops"]

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY: torch.library.Library | None = None


def _has_nms() -> bool:
    try:
        torch._C._get_schema("torchvision::nms", "")
    except RuntimeError:
        return False
    return True


def _load_torchvision_ops() -> bool:
    """Try torchvision's own ``_C`` library (it loads wherever torchvision matches torch); True on success."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    library = Path(spec.origin).with_name("_C.so")
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):
        return False
    return _has_nms()


def declare_torchvision_ops() -> bool:
    """Declare ``torchvision::nms`` and ``torchvision::qnms`` unless torchvision's real ops are available.

    Call before the first ``import timm`` / ``import torchvision``; calling it again is a no-op.

    Returns:
        True when the schemas were declared here (no kernels: calling them raises), False when torchvision's own
        ops loaded or were already declared.

    Raises:
        RuntimeError: torchvision was already imported without its ops (the import then failed half-way).
    """
    global _LIBRARY
    if _LIBRARY is not None or _has_nms() or _load_torchvision_ops():
        return False
    if "torchvision" in sys.modules:
        raise RuntimeError("torchvision was imported before declare_torchvision_ops(); call it before importing "
                           "timm or torchvision")
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)
    return True
