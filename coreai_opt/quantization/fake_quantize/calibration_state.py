"""Calibration state out of the exporter's sight: only the qparams an exported quantizer reads are lifted.

A converted quantizer's forward reads its calculator's ``scale`` and ``zero_point``; the quantizer and its
calculator also hold what calibration needed: the ``observer_enabled`` / ``fake_quant_enabled`` flags, running min /
max, moving averages, histograms (``num_bins`` per row), ``minval``, ``committed``. ``torch.export`` lifts *every*
buffer of the module tree as a graph input, used or not, and its bookkeeping (and every later pass over the
program: decompositions, the ONNX translation, its optimizer) grows with the number of inputs: a ResNet-18 with 52
quantizers lifts 552 inputs, 104 of them read. The ONNX exporter then writes them as initializers for its optimizer
to delete.

:func:`calibration_state_hidden` takes, for the export only, every buffer of each export-mode quantizer and of its
calculator subtree except :data:`EXPORTED_QPARAMS` out of its module's buffers; the tensor stays readable as a plain
attribute of the same name (``repr``, ``has_qparams`` and any reader still see it; a forward that did read one would
make the exporter embed it as a constant, never fail or change a value). When the export ends or fails, each buffer
goes back into the same module, under the same name, in the same order: the user's model is left exactly as it was.
The exported graph and its values are the same (the hidden buffers were never read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize

__all__ = ["EXPORTED_QPARAMS", "calibration_state_hidden"]

#: The calculator buffers an exported quantizer reads.
EXPORTED_QPARAMS = frozenset({"scale", "zero_point"})


@contextmanager
def calibration_state_hidden(model: nn.Module) -> Iterator[int]:
    """Hide the quantizers' calibration buffers for the ``with`` block; yields how many were hidden."""
    hidden: list[tuple[nn.Module, dict[str, Tensor | None]]] = []
    try:
        for quantizer in model.modules():
            if not isinstance(quantizer, FakeQuantize) or not quantizer.export_mode:
                continue
            calculator = quantizer.calculator
            for module in (quantizer, *calculator.modules()):
                keep = EXPORTED_QPARAMS if module is calculator else frozenset()
                if any(name not in keep for name in module._buffers):
                    buffers = dict(module._buffers)
                    hidden.append((module, buffers))
                    module._buffers = {k: v for k, v in buffers.items() if k in keep}
                    module.__dict__.update((k, v) for k, v in buffers.items() if k not in keep)
        yield sum(len(buffers) - len(module._buffers) for module, buffers in hidden)
    finally:
        for module, buffers in reversed(hidden):
            for name in buffers:
                module.__dict__.pop(name, None)
            module._buffers = buffers
