"""Peer quantizers run on the same float ONNX model and the same calibration batches as ours.

* onnxruntime ``quantize_static``: QDQ, per-channel int8 weights, uint8 activations (U8S8), after ``quant_pre_process``,
  with the MinMax, Entropy or Percentile calibrator.
* onnxruntime ``quantize_dynamic``: int8 weights, activations quantized at run time (for the transformer).
* NNCF ``nncf.quantize`` on the ONNX model (default preset), with per-tensor activations: by default NNCF quantizes
  depthwise-conv inputs per channel, which onnxruntime's CPU QLinearConv rejects at run time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from torch import Tensor

from benchmarks.common.onnx_utils import input_name

ORT_STATIC_METHODS = ("MinMax", "Entropy", "Percentile")


class _BatchReader:
    """onnxruntime CalibrationDataReader over a list of torch batches."""

    def __init__(self, name: str, batches: Sequence[Tensor]) -> None:
        self._name = name
        self._batches = [b.numpy() for b in batches]
        self._iter: Iterator[np.ndarray] = iter(self._batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._iter, None)
        return None if batch is None else {self._name: batch}

    def rewind(self) -> None:
        self._iter = iter(self._batches)


def preprocess(float_path: Path, out_path: Path) -> Path:
    """Run onnxruntime's ``quant_pre_process`` (shape inference + graph optimisation) on the float model."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(str(float_path), str(out_path), skip_symbolic_shape=False)
    return out_path


def ort_static(pre_path: Path, batches: Sequence[Tensor], method: str, out_path: Path) -> Path:
    """onnxruntime ``quantize_static`` QDQ U8S8 per-channel with calibrator ``method`` on the preprocessed model."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    extra: dict[str, object] = {}
    if method == "Percentile":
        extra["CalibPercentile"] = 99.999
    with contextlib.redirect_stdout(io.StringIO()):  # the calibrators print progress
        quantize_static(
            str(pre_path),
            str(out_path),
            _BatchReader(input_name(pre_path), batches),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=getattr(CalibrationMethod, method),
            extra_options=extra,
        )
    return out_path


def ort_dynamic(pre_path: Path, out_path: Path) -> Path:
    """onnxruntime ``quantize_dynamic`` with int8 weights (activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(pre_path), str(out_path), weight_type=QuantType.QInt8)
    return out_path


def nncf_quantize(float_path: Path, batches: Sequence[Tensor], out_path: Path) -> Path:
    """NNCF post-training quantization of the float ONNX model with ``len(batches)`` calibration batches."""
    logging.getLogger("nncf").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, QuantizationParameters

        model = onnx.load(str(float_path))
        name = model.graph.input[0].name
        dataset = nncf.Dataset(list(batches), lambda b: {name: b.numpy()})
        per_tensor = AdvancedQuantizationParameters(
            activations_quantization_params=QuantizationParameters(per_channel=False)
        )
        with contextlib.redirect_stdout(io.StringIO()):  # progress bars
            quantized = nncf.quantize(model, dataset, subset_size=len(batches), advanced_parameters=per_tensor)
    onnx.save(quantized, str(out_path))
    return out_path
