"""coreai_opt: PyTorch quantization on torch.fx with exact ONNX QDQ export, verified in onnxruntime.

The flow::

    prepared = coreai_opt.prepare(model, coreai_opt.QuantizerConfig.presets.w8a8(), example_inputs)
    coreai_opt.calibrate(prepared, batches)
    converted = coreai_opt.convert(prepared)
    coreai_opt.export_onnx(converted, example_inputs, "model.onnx")
    report = coreai_opt.verify_onnx(converted, "model.onnx", inputs)

Public names are imported lazily so that ``import coreai_opt`` stays cheap and layers load on demand.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "QuantizerConfig": "coreai_opt.config",
    "QuantizationSpec": "coreai_opt.quantization.spec",
    "prepare": "coreai_opt.api",
    "calibrate": "coreai_opt.api",
    "convert": "coreai_opt.api",
    "summary": "coreai_opt.api",
    "enable_observers": "coreai_opt.api",
    "enable_fake_quant": "coreai_opt.api",
    "load_state_dict": "coreai_opt.api",
    "smooth_quant": "coreai_opt.api.smooth_quant",
    "search_calibration": "coreai_opt.api.calibration_search",
    "sensitivity": "coreai_opt.api.sensitivity",
    "keep_sensitive": "coreai_opt.api.sensitivity",
    "export_onnx": "coreai_opt.onnx",
    "verify_onnx": "coreai_opt.onnx",
    "fusion_report": "coreai_opt.onnx",
    "from_pretrained": "coreai_opt.huggingface",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coreai_opt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
