"""Calibration statistics out of the exporter's sight: only the qparams an exported quantizer reads are lifted.

A converted quantizer's forward reads its calculator's ``scale`` and ``zero_point`` (and a bias quantizer the
``minval`` beside them); the calculator also holds what calibration needed: running min / max, moving averages,
histograms (``num_bins`` per row), flags. ``torch.export`` lifts *every* buffer of the module tree as a graph input,
used or not, and its bookkeeping is quadratic in the number of inputs (a ResNet-18 with 52 quantizers: 547 lifted
inputs, 104 of them read); the ONNX exporter then writes them as initializers for its optimizer to delete, and
lists them all in the file's graph signature.

:func:`calibration_state_hidden` detaches, for the export only, every buffer of each export-mode quantizer's
calculator subtree except :data:`EXPORTED_QPARAMS`, and puts each back in the same module, under the same name, in the
same order, when the export ends or fails: the user's model is left exactly as it was. The exported graph and its
values are the same (the hidden buffers were never read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize

__all__ = ["EXPORTED_QPARAMS", "calibration_state_hidden"]

#: The calculator buffers an exported quantizer reads (``committed``: ``has_qparams``, checked before the trace).
EXPORTED_QPARAMS = frozenset({"scale", "zero_point", "minval", "committed"})


@contextmanager
def calibration_state_hidden(model: nn.Module) -> Iterator[int]:
    """Hide the calculators' calibration buffers for the ``with`` block; yields how many were hidden."""
    hidden: list[tuple[nn.Module, dict[str, Tensor | None]]] = []
    try:
        for quantizer in model.modules():
            if not isinstance(quantizer, FakeQuantize) or not quantizer.export_mode:
                continue
            calculator = quantizer.calculator
            for module in calculator.modules():
                keep = EXPORTED_QPARAMS if module is calculator else frozenset()
                if any(name not in keep for name in module._buffers):
                    hidden.append((module, dict(module._buffers)))
                    module._buffers = {k: v for k, v in module._buffers.items() if k in keep}
        yield sum(len(buffers) - len(module._buffers) for module, buffers in hidden)
    finally:
        for module, buffers in hidden:
            module._buffers = buffers
