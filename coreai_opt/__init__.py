"""coreai_opt: PyTorch quantization on torch.fx with exact ONNX QDQ export, verified in onnxruntime.

The flow::

    prepared = coreai_opt.prepare(model, coreai_opt.QuantizerConfig.presets.w8a8(), example_inputs)
    coreai_opt.calibrate(prepared, batches)
    converted = coreai_opt.convert(prepared)
    coreai_opt.export_onnx(converted, example_inputs, "model.onnx")
    report = coreai_opt.verify_onnx(converted, "model.onnx", inputs)

Overrides use the same vocabulary at top level: ``coreai_opt.OpConfig``, ``coreai_opt.PerTensor``,
``coreai_opt.PerChannel``, ``coreai_opt.PerBlock``. Public names are imported lazily so that ``import coreai_opt``
stays cheap and layers load on demand; the ``TYPE_CHECKING`` block below shows them to type checkers and IDEs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coreai_opt.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from coreai_opt.api import (
        calibrate,
        convert,
        enable_fake_quant,
        enable_observers,
        load_state_dict,
        prepare,
        summary,
    )
    from coreai_opt.api.algorithms.auto_quantize import auto_quantize
    from coreai_opt.api.algorithms.awq import awq
    from coreai_opt.api.algorithms.calibration_search import search_calibration
    from coreai_opt.api.algorithms.sensitivity import keep_sensitive, sensitivity
    from coreai_opt.api.algorithms.smooth_quant import smooth_quant
    from coreai_opt.config import OpConfig, QuantizerConfig
    from coreai_opt.huggingface import from_pretrained
    from coreai_opt.onnx import (
        VerificationReport,
        export_onnx,
        fusion_report,
        localize_divergence,
        verify_onnx,
    )
    from coreai_opt.quantization.spec import PerBlock, PerChannel, PerTensor, QuantizationSpec

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "QuantizerConfig": "coreai_opt.config",
    "OpConfig": "coreai_opt.config",
    "QuantizationSpec": "coreai_opt.quantization.spec",
    "PerTensor": "coreai_opt.quantization.spec",
    "PerChannel": "coreai_opt.quantization.spec",
    "PerBlock": "coreai_opt.quantization.spec",
    "prepare": "coreai_opt.api",
    "calibrate": "coreai_opt.api",
    "convert": "coreai_opt.api",
    "summary": "coreai_opt.api",
    "enable_observers": "coreai_opt.api",
    "enable_fake_quant": "coreai_opt.api",
    "load_state_dict": "coreai_opt.api",
    "smooth_quant": "coreai_opt.api.algorithms.smooth_quant",
    "awq": "coreai_opt.api.algorithms.awq",
    "search_calibration": "coreai_opt.api.algorithms.calibration_search",
    "sensitivity": "coreai_opt.api.algorithms.sensitivity",
    "auto_quantize": "coreai_opt.api.algorithms.auto_quantize",
    "keep_sensitive": "coreai_opt.api.algorithms.sensitivity",
    "export_onnx": "coreai_opt.onnx",
    "verify_onnx": "coreai_opt.onnx",
    "fusion_report": "coreai_opt.onnx",
    "localize_divergence": "coreai_opt.onnx",
    "VerificationReport": "coreai_opt.onnx",
    "from_pretrained": "coreai_opt.huggingface",
}

__all__ = [
    "OpConfig",
    "PerBlock",
    "PerChannel",
    "PerTensor",
    "QuantizationSpec",
    "QuantizerConfig",
    "VerificationReport",
    "auto_quantize",
    "awq",
    "calibrate",
    "convert",
    "enable_fake_quant",
    "enable_observers",
    "export_onnx",
    "from_pretrained",
    "fusion_report",
    "keep_sensitive",
    "load_state_dict",
    "localize_divergence",
    "prepare",
    "search_calibration",
    "sensitivity",
    "smooth_quant",
    "summary",
    "verify_onnx",
]
if set(__all__) != set(_EXPORTS):  # pragma: no cover - a name added to one list only
    raise ImportError("coreai_opt.__all__ and its lazy exports disagree")


__getattr__ = lazy_getattr(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
