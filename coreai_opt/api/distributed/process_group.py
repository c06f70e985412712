"""Process-group queries that also work without one, per-collective timeouts and a barrier that cannot hang."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from coreai_opt.errors import CoreaiOptRuntimeError

__all__ = [
    "DistributedSyncError",
    "Timeout",
    "barrier",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
]

#: Seconds, a timedelta, or None for the process group's own timeout.
Timeout = float | timedelta | None


class DistributedSyncError(CoreaiOptRuntimeError):
    """Raised on every rank when a sync point fails: a rank reported an error, timed out, or disagreed."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a process group is initialised."""
    dist = _dist()
    return bool(dist.is_available() and dist.is_initialized())


def get_rank(group: object | None = None) -> int:
    """Rank of this process in ``group`` (0 without a process group)."""
    return _dist().get_rank(group=group) if is_distributed() else 0


def get_world_size(group: object | None = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return _dist().get_world_size(group=group) if is_distributed() else 1


def is_main_process(group: object | None = None) -> bool:
    """True on rank 0 of ``group``, and always without a process group (print, progress bars, file writes)."""
    return get_rank(group) == 0


def _as_timedelta(timeout: Timeout) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def _comm_device(group: object | None) -> torch.device:
    backend = str(_dist().get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective_error(what: str, timeout: Timeout, exc: BaseException) -> DistributedSyncError:
    """The error every waiting rank raises when collective ``what`` failed or timed out."""
    limit = _as_timedelta(timeout)
    limit_text = f"{limit.total_seconds():g} s" if limit is not None else "the process group timeout"
    return DistributedSyncError(
        f"rank {get_rank()}: collective '{what}' failed or timed out after {limit_text} "
        f"({str(exc).rstrip('.! ')}). Another rank crashed, hangs or skipped this sync point; check its log. "
        "After this error the process group is unusable: call torch.distributed.destroy_process_group()."
    )


def _run(collective: Callable[..., Any], /, *args: Any, timeout: Timeout, what: str, **kwargs: Any) -> None:
    """Run ``collective`` and wait at most ``timeout`` (None: the process group's own timeout).

    Raises:
        DistributedSyncError: the collective failed or timed out.
    """
    limit = _as_timedelta(timeout)
    try:
        if limit is None:
            collective(*args, **kwargs)
        else:
            collective(*args, async_op=True, **kwargs).wait(timeout=limit)
    except DistributedSyncError:
        raise
    except RuntimeError as exc:
        raise _collective_error(what, timeout, exc) from exc


def barrier(group: object | None = None, timeout: Timeout = 300.0) -> None:
    """Wait for every rank of ``group``, at most ``timeout`` seconds; no-op without a process group.

    On gloo this is ``monitored_barrier(wait_all_ranks=True)``: rank 0 names the ranks that did not arrive.

    Raises:
        DistributedSyncError: a rank did not reach the barrier in time (raised on every rank that did).
    """
    if not is_distributed():
        return
    dist = _dist()
    limit = _as_timedelta(timeout)
    if str(dist.get_backend(group)) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=limit, wait_all_ranks=True)
        except RuntimeError as exc:
            raise DistributedSyncError(
                f"rank {get_rank()}: barrier not passed within {limit.total_seconds() if limit else '?'} s: {exc}"
            ) from exc
        return
    _run(dist.barrier, group=group, timeout=limit, what="barrier")
