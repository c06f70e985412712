"""``calibrate``: run data through a prepared model to compute activation qparams.

Calibration is a scoped state: on entry every quantizer's statistics are reset (so the capture example does
not bias them), observers are switched on and fake quantization off (including the int32 bias quantizers,
whose derived scale needs the input scale being calibrated), the model is put in eval mode and
autograd is disabled. Each batch only *observes* (cheap); on a clean exit every quantizer commits its qparams
(``FakeQuantize.commit()``), weight qparams are recomputed from the weights, and the previous mode and flags
are restored.

Batches may be a tensor (one positional input), a tuple/list (positional inputs) or a dict (keyword inputs).
Each is checked against the example inputs given to ``prepare`` by the one input check that ``export_onnx`` and
``verify_onnx`` use too (:mod:`coreai_opt.api.internals.input_checks`): an
:class:`~coreai_opt.errors.InputValidationError` names the batch, the input and the fix.

``sync`` controls merging statistics across ``torch.distributed`` ranks through
:class:`coreai_opt.api.distributed.CalibrationSync`: ``"auto"`` merges once before committing,
``"every_batch"`` also merges order-dependent (moving-average) statistics after each batch, ``"never"`` not
at all. Without an initialised process group nothing happens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from tqdm.auto import tqdm

from coreai_opt.api.distributed import SYNC_MODES, CalibrationSync
from coreai_opt.api.internals.batches import as_call
from coreai_opt.api.internals.hessian_groups import check_reiterable, hessian_budget, hessian_groups
from coreai_opt.api.internals.input_checks import InputCheck, differing_shape
from coreai_opt.api.internals.model_guard import exclusive_model
from coreai_opt.api.internals.quantizer_snapshot import QuantizerSnapshot
from coreai_opt.api.internals.quantizer_state import (
    bias_quantizers,
    commit_weight_qparams,
    fake_quantizers,
    input_statistics,
    weight_quantizer_inputs,
)
from coreai_opt.error_boundary import error_stage, public_api
from coreai_opt.errors import InputValidationError
from coreai_opt.graph.graph_meta import GraphMeta, require_graph_meta
from coreai_opt.quantization.rounding.input_statistics import InputStatistics

__all__ = ["calibrate"]

_END = object()  # end of the calibration data


def _shape_hint(check: InputCheck, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    differing = differing_shape(check.meta, check.given(args, kwargs))
    if differing is None:
        return ""
    spec, shape = differing
    return f"input '{spec.name}' has shape {shape}, the example input had {spec.shape}; "


@public_api
def calibrate(
    prepared: fx.GraphModule,
    data: Iterable[Any],
    *,
    max_batches: int | None = None,
    progress: bool = True,
    sync: str = "auto",
    hessian_memory: int | None = None,
) -> fx.GraphModule:
    """Observe ``data`` and commit the qparams of every quantizer of ``prepared`` (in place).

    Calibration is a transaction: statistics, qparams, flags, train mode and weight commits change only when
    the call completes. An exception or interrupt at any point (a bad batch, the data iterator raising,
    ``KeyboardInterrupt``, a failed ``torch.distributed`` merge, a range float32 cannot hold) puts the model
    back exactly as it was before the call, so ``convert`` keeps giving the earlier qparams.

    One model is calibrated by one call at a time: a second ``calibrate`` (or ``search_calibration`` /
    ``sensitivity``) on the same model while one runs, from another thread or from inside the data iterator,
    raises :class:`~coreai_opt.errors.CalibrationInProgressError` at once. Calibrate copies
    (``copy.deepcopy(prepared)``) in parallel instead.

    Args:
        prepared: A model returned by ``prepare``.
        data: Iterable of batches (tensor, tuple of positional inputs, or dict of keyword inputs).
        max_batches: Stop after this many batches.
        progress: Show a tqdm progress bar.
        sync: ``"auto"``, ``"every_batch"`` or ``"never"`` (torch.distributed statistics merging).
        hessian_memory: Bytes of GPTQ ``d × d`` Hessians accumulated per pass over ``data``; when all of them
            need more, ``data`` is run once per group of linears and each group is rounded and freed before
            the next (:mod:`~coreai_opt.api.internals.hessian_groups`; bit-identical results). None: a quarter of the
            model's fp32 parameter bytes, at least 256 MiB. Several passes need re-iterable ``data`` (a list,
            a DataLoader).

    Returns:
        ``prepared`` itself, calibrated.

    Raises:
        TypeError: ``prepared`` was not produced by ``prepare``.
        ValueError: converted model, empty data, bad ``sync``/``max_batches``, a batch unlike the example, an
            empty batch or token ids outside an embedding (:class:`~coreai_opt.errors.InputValidationError`),
            or a range float32 cannot hold (:class:`~coreai_opt.errors.QParamsRangeError`), a bad
            ``hessian_memory``, or one-shot ``data`` when the Hessians need several passes.
        CalibrationInProgressError: another call is changing this model's quantizers.
    """
    meta = require_graph_meta(prepared, "calibrate")
    if meta.converted:
        raise ValueError("calibrate needs a prepared model, got a converted one; calibrate before convert")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync={sync!r} is not one of {SYNC_MODES}; use sync='auto'")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
    budget = hessian_budget(prepared, hessian_memory)
    groups = hessian_groups(prepared, input_statistics(prepared), budget)
    check_reiterable(data, groups, budget)
    with exclusive_model(prepared, "calibrate"):
        snapshot = QuantizerSnapshot(prepared)
        try:
            _calibrate_in_place(prepared, meta, data, max_batches, progress, sync, groups)
        except BaseException:
            snapshot.restore()
            raise
    return prepared


def _calibrate_in_place(
    prepared: fx.GraphModule, meta: GraphMeta, data: Iterable[Any], max_batches: int | None, progress: bool,
    sync: str, groups: list[list[InputStatistics]],
) -> None:
    """The calibration itself; leaves partial state behind when it raises (``calibrate`` rolls it back).

    The first pass over ``data`` observes every activation and ``groups[0]``'s input statistics; each further
    pass only the next group's Hessians, whose weights are rounded (and the Hessians freed) at its end.
    """
    quantizers = [fq for _, fq in fake_quantizers(prepared)]
    saved = [(bool(fq.observer_enabled), bool(fq.fake_quant_enabled)) for fq in quantizers]
    biases = [bq for _, bq in bias_quantizers(prepared)]
    saved_biases = [bq.fake_quant_enabled for bq in biases]
    # Weights are constants during PTQ: their quantizers are committed from the weights after the loop (and only
    # if a weight changed since its last commit) instead of re-scanning every weight on every batch.
    weight_ids = {id(fq) for fq, _ in weight_quantizer_inputs(prepared)}
    activation_quantizers = [fq for fq in quantizers if id(fq) not in weight_ids]
    was_training = prepared.training
    for fq in quantizers:
        if id(fq) not in weight_ids:  # weight statistics stay those of the weight they were committed from
            fq.reset_statistics()
        fq.enable_observer(id(fq) not in weight_ids)
        fq.enable_fake_quant(False)
    for bq in biases:  # the input scale is a placeholder / stale until commit: keep the float bias meanwhile
        bq.enable_fake_quant(False)
    statistics = input_statistics(prepared)  # data-aware weight rounding (GPTQ ...) observes the linears' inputs
    for stats in statistics:
        stats.reset()
    prepared.eval()
    try:
        for index, group in enumerate(groups):
            for stats in group:
                stats.enabled = True
            if index:  # later passes accumulate this group's Hessians only: the activations are committed
                for fq in activation_quantizers:
                    fq.enable_observer(False)
            desc = "calibrate" if len(groups) == 1 else f"calibrate (pass {index + 1} of {len(groups)})"
            only = None if index == 0 else group
            total_batches = _run_pass(prepared, meta, data, max_batches, progress, sync, desc, only)
            if total_batches == 0:  # no rank had data (one empty rank of several is fine)
                raise ValueError("calibration data is empty: pass an iterable with at least one batch")
            with error_stage("committing the qparams"):
                if index == 0:
                    for fq in activation_quantizers:
                        fq.commit()
                commit_weight_qparams(prepared)  # rounds this group's weights, frees their Hessians
            for stats in group:
                stats.enabled = False
    finally:
        for fq, (observe, fake_quant) in zip(quantizers, saved, strict=True):
            fq.enable_observer(observe)
            fq.enable_fake_quant(fake_quant)
        for bq, fake_quant in zip(biases, saved_biases, strict=True):
            bq.enable_fake_quant(fake_quant)
        for stats in statistics:
            stats.enabled = False
        prepared.train(was_training)


def _run_pass(
    prepared: fx.GraphModule, meta: GraphMeta, data: Iterable[Any], max_batches: int | None, progress: bool,
    sync: str, desc: str, only: list[InputStatistics] | None,
) -> int:
    """Run the batches of ``data`` once; merge across ranks (``only`` these statistics); return the batch total."""
    count = 0
    total = max_batches if max_batches is not None else (len(data) if hasattr(data, "__len__") else None)
    check = InputCheck.for_model(prepared, meta)
    # statistics are merged across torch.distributed ranks (no-op without a process group) before commit
    with torch.no_grad(), CalibrationSync(prepared, sync, only=only) as syncer:
        bar = tqdm(data, total=total, disable=not progress or not syncer.is_main, desc=desc, leave=False)
        batches = iter(bar)
        while max_batches is None or count < max_batches:
            with error_stage(f"reading calibration batch {count} from data"):
                batch = next(batches, _END)
            if batch is _END:
                break
            args, kwargs = as_call(batch)
            check(args, kwargs, f"calibration batch {count}")
            try:
                with error_stage(f"running calibration batch {count} through the model"):
                    prepared(*args, **kwargs)
            except RuntimeError as exc:
                hint = _shape_hint(check, args, kwargs)
                raise InputValidationError(f"calibration batch {count} failed: {hint}{exc}") from exc
            count += 1
            syncer.after_batch()
        bar.close()
    return syncer.total_batches
