"""Data-parallel calibration on ``torch.distributed``: merge quantizer statistics so every rank ends identical.

Each rank calibrates on its own shard of the data; :func:`sync_statistics` then merges the statistics of
every stateful calculator in the model, in sorted module-name order, so that all ranks commit the same
qparams. Without an initialised process group everything here is a no-op (or runs locally).

**Who owns what.** The merge rules live in the spec layer: each stateful qparams calculator merges with
``sync_statistics(group, *, only_order_dependent=False)`` and each range calculator with
``all_reduce(group)``, both safe on a rank without data (shape agreed first, neutral elements). This
package only orchestrates them (per rank, ``r`` over the ranks, per qparam group):

=======================================  ==========================================================
calculator                               merge across ranks (spec-layer method)
=======================================  ==========================================================
``global_minmax`` (running min / max)    ``MIN_r`` of mins, ``MAX_r`` of maxes
``static`` + ``minmax``                  ``MIN_r`` / ``MAX_r`` of the last batch of every rank
``static`` + percentile / mse / entropy  ``SUM_r`` of the power-of-two histograms on the common grid
                                         (bit-exact: the single-process histogram of all shards)
``moving_average`` (order-dependent)     ``m = Σ_r w_r·m_r / Σ_r w_r`` (float64, rank order), ``w_r`` =
                                         batches rank ``r`` observed since the last merge
=======================================  ==========================================================

Modules: :mod:`.process_group` (rank queries, timeouts, :func:`barrier`, :class:`DistributedSyncError`),
:mod:`.status` (the error / fingerprint collective, :func:`report_failure`), :mod:`.sync`
(:func:`sync_statistics`), :mod:`.calibration_sync` (:class:`CalibrationSync`, :data:`SYNC_MODES`) and
:mod:`.write_once` (:func:`run_on_main`, :func:`save_on_main`, :func:`check_synchronized`).

**Failures.** Every sync point starts with one status collective carrying a per-rank error flag and a
fingerprint of the quantizer names. A rank whose calibration raised reports it there
(:func:`report_failure`, done by :class:`CalibrationSync`) and every other rank raises
:class:`DistributedSyncError` naming it, instead of waiting in a collective. A rank that dies or hangs
without reporting is caught by the timeout (``timeout=`` here, else the process group's own timeout from
``dist.init_process_group(..., timeout=...)``). See ``docs/distributed.md``.
"""

from __future__ import annotations

from coreai_opt.api.distributed.calibration_sync import SYNC_MODES, CalibrationSync
from coreai_opt.api.distributed.process_group import (
    DistributedSyncError,
    Timeout,
    barrier,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
)
from coreai_opt.api.distributed.status import report_failure
from coreai_opt.api.distributed.sync import sync_statistics
from coreai_opt.api.distributed.write_once import check_synchronized, run_on_main, save_on_main

__all__ = [
    "SYNC_MODES",
    "CalibrationSync",
    "DistributedSyncError",
    "Timeout",
    "barrier",
    "check_synchronized",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
    "report_failure",
    "run_on_main",
    "save_on_main",
    "sync_statistics",
]
