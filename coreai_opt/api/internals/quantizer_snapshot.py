"""``QuantizerSnapshot``: the state ``calibrate`` may change, taken on entry and put back when it fails.

What is saved (nothing of the float model: weights and non-quantizer buffers are never touched by calibrate):

* every quantizer subtree (``FakeQuantize`` / ``BiasFakeQuantize`` with their qparams and range calculators and
  histograms): the buffers (``scale``, ``zero_point``, statistics, the observer / fake-quant flags) and the plain
  attributes (``_pending``, ``batches_since_sync``, warn-once flags, ...);
* the ``training`` flag of every module of the model;
* the "committed from this weight" records of the weight quantizers
(:func:`~coreai_opt.api.internals.quantizer_state.commit_records`).

Cost: buffers are cloned, except those of weight quantizers whose weight is unchanged since their last commit
(calibrate neither observes nor recommits them; only their small flag buffers are cloned), and those whose weight
rounding is data-aware (GPTQ, weighted MSE: their statistics and qparams are always cloned; the rounding's own
integers and qparams, which ``commit`` replaces and never writes in place, are kept by reference and their version
checked on restore). A data-aware weight quantizer still on its provisional, data-free result (``awaiting_data``:
committed from its weight only, as ``prepare`` leaves a GPTQ weight) is not saved at all beyond its flags and small
buffers: restore commits it again from its weight, which gives the same integers and qparams bit for bit (the
data-free path is deterministic). Holding its result instead kept every provisional result alive next to the
new one until calibrate returned (a TinyLlama-wide decoder: the integers, qparams and range of every linear,
0.5x of the fp32 weights). So the snapshot is the
size of the activation statistics (per-tensor min/max: a few bytes; a histogram: ``num_bins`` int64 per row) plus
the qparams of weights that changed since the last commit; :attr:`QuantizerSnapshot.nbytes` reports it.

Restore writes saved values back *into the original buffer tensors* (when they were changed in place), so
references to the qparams tensors (``fq.get_qparams().scale``) held elsewhere see the restored values, and
rebinds buffers that were replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from coreai_opt.api.internals.quantizer_state import (
    commit_from_weight,
    commit_records,
    restore_commit_records,
    stale_weight_quantizers,
    weight_quantizer_inputs,
)
from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.quantization.rounding.input_statistics import InputStatistics
from coreai_opt.quantization.rounding.weight_rounding import WeightRoundingBase
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize

__all__ = ["QuantizerSnapshot"]

#: ``nn.Module`` bookkeeping (parameter / buffer / submodule tables, hooks, ``training``): restored separately or
#: never changed by calibrate.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
#: Buffers up to this many elements are always cloned (flags, per-tensor qparams).
_SMALL_BUFFER = 64


@dataclass
class _SavedBuffer:
    tensor: Tensor | None
    version: int
    copy: Tensor | None  # None: not cloned (calibrate does not touch it)
    rebuilt: bool = False  # not saved: restore recommits the quantizer from its weight


@dataclass
class _SavedModule:
    module: nn.Module
    attributes: dict[str, Any]
    buffers: dict[str, _SavedBuffer]

    @classmethod
    def take(cls, module: nn.Module, clone_all: bool, rebuilt: bool = False) -> _SavedModule:
        """Save ``module``; ``rebuilt``: keep only its small buffers (restore recommits the rest)."""
        attributes = {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}
        buffers = {}
        for name, tensor in module._buffers.items():
            small = tensor is None or tensor.numel() <= _SMALL_BUFFER
            if rebuilt and not small:
                buffers[name] = _SavedBuffer(None, 0, None, rebuilt=True)
                continue
            clone = tensor is not None and (clone_all or small)
            buffers[name] = _SavedBuffer(tensor, tensor._version if tensor is not None else 0,
                                         tensor.detach().clone() if clone else None)
        return cls(module, attributes, buffers)

    def restore(self) -> None:
        state = self.module.__dict__
        for key in [k for k in state if k not in _MODULE_INTERNALS and k not in self.attributes]:
            del state[key]
        state.update(self.attributes)
        table = self.module._buffers
        for name in [n for n in table if n not in self.buffers]:
            del table[name]
        for name, saved in self.buffers.items():
            if saved.rebuilt:
                continue  # the recommit after every module's restore writes it
            tensor = saved.tensor
            if tensor is not None and saved.copy is None and tensor._version != saved.version:
                raise CoreaiOptRuntimeError(
                    f"internal error: calibrate wrote {type(self.module).__name__}.{name} in place, which the "
                    "snapshot saved by reference, so the rollback cannot restore it; please report it")
            if tensor is not None and saved.copy is not None and tensor._version != saved.version:
                if tensor.shape == saved.copy.shape:
                    with torch.no_grad():
                        tensor.copy_(saved.copy)
                else:  # resized in place: the saved copy becomes the buffer
                    tensor = saved.copy
            table[name] = tensor

    @property
    def nbytes(self) -> int:
        return sum(b.copy.numel() * b.copy.element_size() for b in self.buffers.values() if b.copy is not None)


class QuantizerSnapshot:
    """Everything ``calibrate`` may change in ``model``; :meth:`restore` puts it back exactly.

    Args:
        model: A prepared model.

    Example:
        >>> snapshot = QuantizerSnapshot(prepared)      # doctest: +SKIP
        >>> try: run_calibration(prepared)              # doctest: +SKIP
        ... except BaseException: snapshot.restore(); raise
    """

    def __init__(self, model: fx.GraphModule) -> None:
        weight_quantizers = [fq for fq, _ in weight_quantizer_inputs(model)]
        stale = {id(fq) for fq, _ in stale_weight_quantizers(model)}
        # data-aware weight rounding (GPTQ ...) observes and re-rounds during calibrate: always cloned
        untouched = {id(fq) for fq in weight_quantizers if id(fq) not in stale and not fq.rounds_with_data}
        # provisional data-free results (module docstring): recommitted from the weight on restore, not saved
        self._rebuilt = [(fq, weight) for fq, weight in weight_quantizer_inputs(model)
                         if id(fq) not in stale and fq.rounds_with_data and fq.rounding is not None
                         and fq.rounding.has_result and bool(fq.rounding.awaiting_data)]
        rebuilt = {id(fq) for fq, _ in self._rebuilt}
        self._modules: list[_SavedModule] = []
        for root in model.modules():
            if id(root) in rebuilt:  # its input statistics are cloned as before (empty before a calibrate)
                self._modules += [_SavedModule.take(m, True) if isinstance(m, InputStatistics)
                                  else _SavedModule.take(m, False, rebuilt=True) for m in root.modules()]
            elif isinstance(root, (FakeQuantize, BiasFakeQuantize)):
                clone_all = id(root) not in untouched
                # a rounding's results (integers, qparams, fingerprint) are replaced by commit, never written in
                # place: saved by reference (restore checks their version), not cloned (0.3x of a GPTQ model)
                self._modules += [_SavedModule.take(m, clone_all and not isinstance(m, WeightRoundingBase))
                                  for m in root.modules()]
        self._training = [(m, m.training) for m in model.modules()]
        self._records = commit_records(weight_quantizers)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the snapshot holds (the clones)."""
        return sum(saved.nbytes for saved in self._modules)

    def restore(self) -> None:
        """Put every saved buffer, attribute, training flag and commit record back."""
        for saved in self._modules:
            saved.restore()
        for fq, weight in self._rebuilt:  # as commit_weight_qparams did before calibrate: same bits
            fq.rounding.qweight = torch.empty(0, dtype=torch.int8, device=fq.rounding.qweight.device)
            commit_from_weight(fq, weight)  # its commit record is put back below
        for module, training in self._training:
            module.training = training
        restore_commit_records(self._records)
