"""coreai_opt's own flow as the benchmarks use it: preset → prepare → calibrate → convert → export_onnx."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, fx, nn

import coreai_opt as co

W4_BLOCK = 32
RANGE_CALCULATORS = ("minmax", "moving_average", "percentile", "mse", "entropy")


def api_missing() -> str | None:
    """None when prepare/calibrate/convert/export_onnx can be imported, else the reason they cannot."""
    for name in ("QuantizerConfig", "prepare", "calibrate", "convert", "export_onnx"):
        try:
            getattr(co, name)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available yet"
            return f"coreai_opt.{name} unavailable ({type(exc).__name__}: {exc})"
    return None


def config(preset: str, range_calculator: str | None = None, model: nn.Module | None = None) -> object:
    """``QuantizerConfig.presets.<preset>()``, passing the activation range calculator for w8a8.

    For ``w4`` (int4 per-block, 32 input channels per block) every conv / linear of ``model`` whose input channels
    are not a multiple of 32 gets int4 per-channel weights instead, the fix the preset's error message names.
    """
    factory = getattr(co.QuantizerConfig.presets, preset)
    cfg = factory() if range_calculator is None else factory(range_calculator)
    if preset == "w4" and model is not None:
        cfg = _w4_fallbacks(cfg, model)
    return cfg


def _w4_fallbacks(cfg: object, model: nn.Module, block_size: int = W4_BLOCK) -> object:
    from coreai_opt.config import OpConfig
    from coreai_opt.quantization.spec import PerChannel, QuantizationSpec

    per_channel = OpConfig(weight=QuantizationSpec(dtype="int4", granularity=PerChannel(axis=0)))
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear)) and weight is not None:
            if weight.shape[1] % block_size:
                cfg.set_module_name(re.escape(name), per_channel)
    return cfg


def quantize(
    model: nn.Module,
    cfg: object,
    example: Tensor,
    calib_batches: Sequence[Tensor],
    *,
    qat_step: Callable[[fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """prepare + calibrate + (optional QAT fine-tuning) + convert on a copy of ``model``."""
    model = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = co.prepare(model, cfg, (example,), qat=qat_step is not None)
        co.calibrate(prepared, [(b,) for b in calib_batches], progress=False)
        if qat_step is not None:
            qat_step(prepared)
        converted = co.convert(prepared)
    return converted.eval()


def export(converted: nn.Module, example: Tensor, path: Path) -> Path:
    """``co.export_onnx`` with dynamic batch."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        co.export_onnx(converted, (example,), path)
    return path
