r"""How many samples of a batch the quantizer-by-quantizer comparison holds at once.

:func:`~coreai_opt.onnx.verify.quantizer_codes.compare_quantizer_codes` keeps every activation quantizer's output of
its batch twice: onnxruntime's (the instrumented copy returns each one) and eager's (recorded call by call). Per side
that is :math:`\sum_{calls} numel \cdot 4` bytes, which grows with the batch: timm's HaloNet-H1 at 256 px calls 717
activation quantizers on 9.5 GiB for 8 images, and verify ran out of memory. So the comparison, and the rerun of a
failing output on the file's codes, use the leading

.. math::

    n = \min(N, \max(1, \lfloor B / b \rfloor))

samples of each batch, with :math:`N` the batch's size, :math:`b` the bytes of one sample's activation-quantizer
outputs (counted during verify's own eager forward of the first batch, divided by :math:`N`) and
:math:`B` = :data:`CODES_BUDGET_BYTES`. The outputs themselves
are compared on every sample. Tensors whose first dimension is not the batch's (a position table, a mask of one
row) are passed whole.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import fx, nn

from coreai_opt.graph.node_meta import Role, called_quantizer

__all__ = ["CODES_BUDGET_BYTES", "ActivationBytes", "batch_size", "leading_rows", "leading_samples",
           "samples_within_budget"]

#: Bytes of activation-quantizer outputs one side of the comparison may hold (eager's and onnxruntime's each).
CODES_BUDGET_BYTES = 1 << 30


def batch_size(batch: tuple[torch.Tensor, ...]) -> int:
    """Samples in ``batch`` (the first input's first dimension; 1 for a scalar)."""
    return int(batch[0].shape[0]) if batch[0].dim() else 1


def leading_samples(batch: tuple[torch.Tensor, ...], n: int) -> tuple[torch.Tensor, ...]:
    """The first ``n`` samples of every tensor of ``batch`` whose first dimension is the batch's."""
    size = batch_size(batch)
    return tuple(t[:n] if t.dim() and t.shape[0] == size else t for t in batch)


def leading_rows(array: np.ndarray, n: int, size: int) -> np.ndarray:
    """The first ``n`` rows of an output of a batch of ``size`` samples (whole when its first dimension is not)."""
    return array[:n] if array.ndim and array.shape[0] == size else array


class ActivationBytes:
    """Counts the bytes every activation quantizer call of a GraphModule outputs while it is entered.

    Entered around verify's own eager forward of the first batch (no extra forward): ``bytes`` is then that batch's
    total.
    """

    def __init__(self, model: nn.Module) -> None:
        self.bytes = 0
        self._quantizers = ({called_quantizer(model, node, Role.ACTIVATION) for node in model.graph.nodes} - {None}
                            if isinstance(model, fx.GraphModule) else set())
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _count(self, module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        self.bytes += output.numel() * output.element_size()

    def __enter__(self) -> ActivationBytes:
        self._handles = [q.register_forward_hook(self._count) for q in self._quantizers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def samples_within_budget(model: nn.Module, batch: tuple[torch.Tensor, ...], batch_bytes: int,
                          budget: int | None = None) -> int:
    """The ``n`` of the module docstring for ``batch``, whose activation quantizers output ``batch_bytes``.

    ``budget``: bytes per side, default :data:`CODES_BUDGET_BYTES` (read at the call). When ``n`` is below the
    batch's size, the model must run on ``n`` samples; one captured for its example batch only (a static batch
    dimension) is compared on the whole batch.
    """
    budget = CODES_BUDGET_BYTES if budget is None else budget
    size = batch_size(batch)
    if batch_bytes <= budget or size <= 1:
        return size
    n = max(1, budget * size // batch_bytes)
    try:
        with torch.no_grad():
            model(*leading_samples(batch, n))
    except Exception:  # noqa: BLE001 - any refusal of a smaller batch (a shape guard) means: keep the batch
        return size
    return n
