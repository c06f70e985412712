"""Process-group queries that also work without one, checked collectives and a barrier that cannot hang.

The primitives themselves (rank, world size, communication device, a collective with a timeout) are the spec
layer's (:mod:`coreai_opt.quantization.collectives`); this module adds :class:`DistributedSyncError`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.quantization.collectives import (
    as_timedelta,
    get_rank,
    get_world_size,
    is_distributed,
    run_collective,
    torch_distributed,
)

__all__ = [
    "DistributedSyncError",
    "Timeout",
    "barrier",
    "collective_error",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
    "run_checked",
]

#: Seconds, a timedelta, or None for the process group's own timeout.
Timeout = float | timedelta | None


class DistributedSyncError(CoreaiOptRuntimeError):
    """Raised on every rank when a sync point fails: a rank reported an error, timed out, or disagreed."""


def is_main_process(group: object | None = None) -> bool:
    """True on rank 0 of ``group``, and always without a process group (print, progress bars, file writes)."""
    return get_rank(group) == 0


def collective_error(what: str, timeout: Timeout, exc: BaseException) -> DistributedSyncError:
    """The error every waiting rank raises when collective ``what`` failed or timed out."""
    limit = as_timedelta(timeout)
    limit_text = f"{limit.total_seconds():g} s" if limit is not None else "the process group timeout"
    return DistributedSyncError(
        f"rank {get_rank()}: collective '{what}' failed or timed out after {limit_text} "
        f"({str(exc).rstrip('.! ')}). Another rank crashed, hangs or skipped this sync point; check its log. "
        "After this error the process group is unusable: call torch.distributed.destroy_process_group()."
    )


def run_checked(collective: Callable[..., Any], /, *args: Any, timeout: Timeout, what: str, **kwargs: Any) -> None:
    """Run ``collective`` and wait at most ``timeout`` (None: the process group's own timeout).

    Raises:
        DistributedSyncError: the collective failed or timed out.
    """
    try:
        run_collective(collective, *args, timeout=timeout, **kwargs)
    except DistributedSyncError:
        raise
    except RuntimeError as exc:
        raise collective_error(what, timeout, exc) from exc


def barrier(group: object | None = None, timeout: Timeout = 300.0) -> None:
    """Wait for every rank of ``group``, at most ``timeout`` seconds; no-op without a process group.

    On gloo this is ``monitored_barrier(wait_all_ranks=True)``: rank 0 names the ranks that did not arrive.

    Raises:
        DistributedSyncError: a rank did not reach the barrier in time (raised on every rank that did).
    """
    if not is_distributed():
        return
    dist = torch_distributed()
    limit = as_timedelta(timeout)
    if str(dist.get_backend(group)) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=limit, wait_all_ranks=True)
        except RuntimeError as exc:
            raise DistributedSyncError(
                f"rank {get_rank()}: barrier not passed within {limit.total_seconds() if limit else '?'} s: {exc}"
            ) from exc
        return
    run_checked(dist.barrier, group=group, timeout=limit, what="barrier")
