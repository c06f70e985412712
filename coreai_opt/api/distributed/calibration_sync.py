"""``CalibrationSync``: the distributed hook ``calibrate`` drives (per-step / end-of-run merges, failures)."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from coreai_opt.api.distributed.process_group import Timeout, is_distributed, is_main_process
from coreai_opt.api.distributed.status import exchange_status, report_failure
from coreai_opt.api.distributed.sync import (
    order_dependent_items,
    quantizer_fingerprint,
    stateful_calculators,
    sync_items,
)

__all__ = ["SYNC_MODES", "CalibrationSync"]

#: Accepted values of ``calibrate(..., sync=...)``.
SYNC_MODES: tuple[str, ...] = ("auto", "every_batch", "never")


class CalibrationSync:
    """The distributed part of ``calibrate``: per-batch / end-of-run merges and failure propagation.

    Usage inside ``calibrate`` (statistics are merged before the qparams are committed)::

        with CalibrationSync(prepared, sync) as syncer:      # no-op without a process group
            for batch in batches:
                run(batch)
                syncer.after_batch()
        if syncer.total_batches == 0: raise ...            # no rank had data (a single empty rank is fine)
        commit every quantizer

    ``sync``: ``"auto"`` merges once when the loop ends (if a process group is initialised);
    ``"every_batch"`` merges order-dependent (moving-average) statistics after every step, ranks that ran out
    of data keep joining until every rank is done, then merges the rest once; ``"never"`` never merges.
    On an exception inside the block, the other ranks are told (they raise ``DistributedSyncError``)
    and the exception propagates.

    Moving averages weigh each rank by the batches its calculator observed since the previous merge
    (``batches_since_sync``): ``w_r`` = the rank's batch count with ``"auto"``, 1 or 0 (ran a batch in this
    step or not) with ``"every_batch"``.

    Args:
        model: The prepared model.
        sync: One of :data:`SYNC_MODES`.
        group: Process group (default: the world).
        timeout: Per-collective timeout in seconds; None uses the process group timeout.
        only: Merge only these calculators (a later pass of a multi-pass calibration); None: all of them.

    Raises:
        ValueError: unknown ``sync``.
    """

    def __init__(
        self, model: nn.Module, sync: str = "auto", group: object | None = None, timeout: Timeout = None, *,
        only: Collection[nn.Module] | None = None,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync={sync!r} is not one of {', '.join(map(repr, SYNC_MODES))}; use sync='auto'")
        self.model = model
        self.mode = sync
        self.group = group
        self.timeout = timeout
        self.enabled = sync != "never" and is_distributed()
        self.batches = 0  # batches this rank ran
        self.total_batches = 0  # batches all ranks ran (known after finish(); == batches when not enabled)
        self.synced = 0  # calculators merged by finish()
        self._items = stateful_calculators(model) if self.enabled else []
        if only is not None:  # a later calibration pass: the other statistics were merged already
            chosen = {id(m) for m in only}
            self._items = [(name, m) for name, m in self._items if id(m) in chosen]
        self._ordered = order_dependent_items(self._items)

    @property
    def is_main(self) -> bool:
        """True on rank 0 (or without a process group): show progress bars / write files here only."""
        return is_main_process(self.group)

    def after_batch(self) -> None:
        """Call after each calibration batch (merges moving averages when ``sync="every_batch"``)."""
        self.batches += 1
        if self.enabled and self.mode == "every_batch":
            self._step(active=True)

    def _step(self, active: bool) -> bool:
        status = exchange_status(
            self.group, self.timeout, fingerprint=quantizer_fingerprint(self._ordered), count=len(self._ordered),
            active=active,
        )
        if status.any_active:
            sync_items(self._ordered, self.group, self.timeout, only_order_dependent=True)
        return status.any_active

    def finish(self) -> int:
        """Call once the loop is over: the final merge; sets :attr:`total_batches`. Returns :attr:`synced`."""
        self.total_batches = self.batches
        if not self.enabled:
            return 0
        if self.mode == "every_batch":
            while self._step(active=False):
                pass
        status = exchange_status(
            self.group,
            self.timeout,
            fingerprint=quantizer_fingerprint(self._items),
            count=len(self._items),
            batches=self.batches,
        )
        self.total_batches = sum(status.batches)
        self.synced = sync_items(self._items, self.group, self.timeout)
        return self.synced

    def fail(self, error: BaseException) -> None:
        """Report ``error`` to the other ranks (no-op when disabled or already a ``DistributedSyncError``)."""
        if self.enabled:
            report_failure(error, self.group, self.timeout)

    def __enter__(self) -> CalibrationSync:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.finish()
        elif isinstance(exc, Exception):
            self.fail(exc)
