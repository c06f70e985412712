"""What the per-quantizer comparison costs: ``verify_onnx`` time with ``check_quantizers=True`` over ``False``.

``check_quantizers=False`` is ``verify_onnx`` as it was before the per-quantizer rules (output comparison, derived
tolerances, fusion report; localization only when an output fails, which a clean file never does). Five zoo models
(the test zoo's sizes, ``tests/zoo.py``), w8a8, 4 batches of 16 (as the zoo mutation suite). Rounds are interleaved:
each round times every model both ways, alternating which goes first; a round's ratio is ``t(True) / t(False)``
and the table gives the median ratio and its p25-p75 over the rounds.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

import coreai_opt as co
from coreai_opt import reference_models as rm
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["CostRow", "ZOO_MODELS", "measure_cost"]


def _images(batch: int) -> Tensor:
    return torch.randn(batch, 3, 32, 32)


#: name -> (model factory, input of a batch size): the test zoo's sizes.
ZOO_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Tensor]]] = {
    "resnet18": (lambda: rm.resnet18_style(10, width=8), _images),
    "mobilenet_v2": (lambda: rm.mobilenet_v2_style(10, 0.25), _images),
    "conv_transpose_decoder": (lambda: rm.ConvTransposeDecoder(3, 8, 3), _images),
    "transformer_encoder": (lambda: rm.transformer_encoder(dim=32, depth=2, heads=4, vocab_size=100, max_len=16),
                            lambda b: torch.randint(0, 100, (b, 12))),
    "conv1d_groupnorm": (lambda: rm.Conv1dGroupNorm(4, 16, 10, 4), lambda b: torch.randn(b, 4, 32)),
}


@dataclass(frozen=True)
class CostRow:
    """One model's verify times (seconds, medians over rounds) and the ratio's median and p25-p75."""

    name: str
    seconds_with: float
    seconds_without: float
    ratio: float
    ratio_p25: float
    ratio_p75: float
    rounds: int


def _export(name: str, work: Path) -> tuple[nn.Module, Path, list[Tensor]]:
    factory, make_input = ZOO_MODELS[name]
    torch.manual_seed(0)
    model = randomize_batchnorm(factory(), 0).eval()
    example = (make_input(2),)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), example)
    co.calibrate(prepared, [make_input(8) for _ in range(4)], progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, example, work / f"{name}.onnx")
    torch.manual_seed(123)
    return converted, Path(path), [make_input(16) for _ in range(4)]


def measure_cost(rounds: int, names: tuple[str, ...] = tuple(ZOO_MODELS)) -> list[CostRow]:
    """Interleaved rounds of ``verify_onnx`` with and without the per-quantizer comparison (module docstring)."""
    times: dict[str, dict[bool, list[float]]] = {n: {True: [], False: []} for n in names}
    with tempfile.TemporaryDirectory(prefix="verify_cost_") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exports = {n: _export(n, Path(tmp)) for n in names}
        for r in range(rounds):
            for name, (model, path, batches) in exports.items():
                for check in ((True, False) if r % 2 == 0 else (False, True)):
                    start = time.perf_counter()
                    report = co.verify_onnx(model, path, batches, check_quantizers=check)
                    times[name][check].append(time.perf_counter() - start)
                    if not report.ok:
                        raise AssertionError(f"clean {name} flagged (check_quantizers={check}):\n{report}")
    rows = []
    for name in names:
        ratios = np.array(times[name][True]) / np.array(times[name][False])
        rows.append(CostRow(name, statistics.median(times[name][True]), statistics.median(times[name][False]),
                            float(np.median(ratios)), float(np.percentile(ratios, 25)),
                            float(np.percentile(ratios, 75)), rounds))
    return rows
