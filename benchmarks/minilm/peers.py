"""Peer quantizers on the float MiniLM ONNX model (two inputs: ``input_ids``, ``attention_mask``).

* ``export_float``: ``torch.onnx.export(dynamo=True)``, dynamic batch, fixed sequence length (opset 18; the
  int4 table starts from opset 21).
* ``ort_static``: ``quant_pre_process`` then ``quantize_static`` (QDQ, per-channel int8 weights, uint8
  activations, MinMax calibration).
* ``ort_dynamic``: ``quantize_dynamic`` (uint8 dynamic activations, int8 weights), per-tensor or per-channel.
* ``nncf_transformer``: ``nncf.quantize(onnx_model, dataset, model_type=ModelType.TRANSFORMER)``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

__all__ = ["export_float", "nncf_transformer", "ort_dynamic", "ort_static", "preprocess"]

_INPUTS = ("input_ids", "attention_mask")


def export_float(model: nn.Module, example: tuple[Tensor, Tensor], path: Path, opset: int = 18) -> Path:
    """Export the float embedder with the dynamo exporter (``opset``, dynamic batch) to one file."""
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, example, dynamo=True, opset_version=opset, input_names=list(_INPUTS),
                                    output_names=["sentence_embedding"], dynamic_shapes=({0: batch}, {0: batch}),
                                    external_data=False, verbose=False)
    onnx.save(program.model_proto, path)
    return path


class _Reader:
    """``CalibrationDataReader`` over ``(input_ids, attention_mask)`` batches."""

    def __init__(self, batches: Sequence[tuple[Tensor, Tensor]]) -> None:
        self._it = iter([{"input_ids": i.numpy(), "attention_mask": m.numpy()} for i, m in batches])

    def get_next(self) -> dict | None:
        return next(self._it, None)


def preprocess(float_path: Path, out_path: Path) -> Path:
    """``quant_pre_process``: ONNX shape inference + graph optimisation (its symbolic shape inference fails here)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(str(float_path), str(out_path), skip_symbolic_shape=True)
    return out_path


def ort_static(pre_path: Path, batches: Sequence[tuple[Tensor, Tensor]], out_path: Path) -> Path:
    """QDQ U8S8, per-channel weights, MinMax calibration."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(str(pre_path), str(out_path), _Reader(batches), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    return out_path


def ort_dynamic(pre_path: Path, out_path: Path, per_channel: bool) -> Path:
    """``quantize_dynamic`` with int8 weights (per-tensor or per-channel) and dynamic uint8 activations."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(pre_path), str(out_path), per_channel=per_channel, weight_type=QuantType.QInt8)
    return out_path


def nncf_transformer(float_path: Path, batches: Sequence[tuple[Tensor, Tensor]], out_path: Path) -> Path:
    """NNCF post-training quantization of the ONNX model in transformer mode."""
    import nncf

    logging.getLogger("nncf").setLevel(logging.ERROR)
    model = onnx.load(str(float_path))
    items = [{"input_ids": i.numpy(), "attention_mask": m.numpy()} for i, m in batches]
    dataset = nncf.Dataset(items)
    quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=sum(i.shape[0] for i, _ in batches))
    onnx.save(quantized, str(out_path))
    return out_path
