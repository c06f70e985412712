"""ONNX export, onnxruntime verification and fusion reporting for converted coreai_opt models.

* :func:`export_onnx` writes a checked QDQ model (weights stored quantized, opset chosen from the dtypes).
* :func:`verify_onnx` compares onnxruntime with the eager converted model and returns a
  :class:`VerificationReport`.
* :func:`fusion_report` shows which convolutions and matrix products onnxruntime runs as integer kernels.
* :func:`localize_divergence` names the first quantizer (or layer) where onnxruntime and eager part.
"""

from __future__ import annotations

from coreai_opt.onnx.export.export_onnx import export_onnx
from coreai_opt.onnx.verify.fusion_report import FusionReport, fusion_report
from coreai_opt.onnx.verify.localize import Divergence, localize_divergence
from coreai_opt.onnx.verify.verify_onnx import VerificationReport, verify_onnx

__all__ = [
    "export_onnx",
    "verify_onnx",
    "fusion_report",
    "localize_divergence",
    "VerificationReport",
    "FusionReport",
    "Divergence",
]
