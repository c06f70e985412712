"""Our MiniLM pipeline: prepare (export capture) → calibrate → convert → export_onnx."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, fx, nn

import coreai_opt as co
from coreai_opt.quantization.spec import FakeQuantize

__all__ = ["export", "has_dynamic", "prepare_calibrate"]


def has_dynamic(model: nn.Module) -> bool:
    """True when ``model`` holds a dynamic (exports-without-calibration) quantizer."""
    return any(isinstance(m, FakeQuantize) and m.exports_dynamic for m in model.modules())


def prepare_calibrate(model: nn.Module, config: object, example: tuple[Tensor, ...],
                      batches: Sequence[tuple[Tensor, ...]]) -> fx.GraphModule:
    """``co.prepare`` + ``co.calibrate``; returns the calibrated prepared model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = co.prepare(model, config, example, capture="export")
    co.calibrate(prepared, list(batches), progress=False)
    return prepared


def export(prepared: fx.GraphModule, example: tuple[Tensor, ...], path: Path) -> tuple[fx.GraphModule, Path]:
    """Convert and export ``prepared``; returns ``(converted, path)``."""
    converted = co.convert(prepared)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        co.export_onnx(converted, example, path, output_names=["sentence_embedding"])
    return converted, path
