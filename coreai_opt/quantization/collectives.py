"""The distributed primitives of coreai_opt and the collectives behind every cross-rank merge of the spec layer.

The primitives (:func:`torch_distributed`, :func:`is_distributed`, :func:`get_rank`, :func:`get_world_size`,
:func:`comm_device`, :func:`run_collective`) live here, in the lowest layer that uses them; the API package
``coreai_opt.api.distributed`` builds its status exchange, barriers and write-once helpers on them.

Every mergeable statistic follows one protocol, so that a rank that saw no data joins the same collectives
as the others and every rank ends with identical bits:

1. **Agree the shape** (:func:`agree_shape`): one MAX all-reduce of ``[n, d_1, ..., d_n, -1, ...]`` (padded
   to :data:`MAX_SHAPE_RANK`) next to its negation. ``MAX(v)`` gives the shape, ``-MAX(-v) = MIN(v)`` the
   smallest one, and the two must agree; a rank without a shape sends a sentinel that loses both MAXes.
   The check raises the same ``ValueError`` on every rank.
2. **Neutral elements**: a rank without data fills the agreed shape with the identity of the reduction:
   ``+inf`` for MIN, ``-inf`` for MAX, ``0`` for SUM and for weights.
3. **Reduce** (:func:`all_reduce`, :func:`all_gather`). Weighted means are summed in float64 in rank order
   from an ``all_gather``, so that every rank computes the same bits.

Without a :func:`collective_timeout` the collectives block like ``torch.distributed`` does (the process
group's own timeout applies). Inside ``with collective_timeout(t):`` each collective waits at most ``t`` and
raises ``RuntimeError`` after it; the API layer (``coreai_opt.api.distributed``) sets it and turns those
errors into ``DistributedSyncError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "MAX_SHAPE_RANK",
    "agree_shape",
    "all_gather",
    "all_reduce",
    "as_timedelta",
    "collective_timeout",
    "comm_device",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "run_collective",
    "torch_distributed",
]

#: Largest tensor rank :func:`agree_shape` exchanges.
MAX_SHAPE_RANK: int = 8

_UNKNOWN = -(2**62)  # loses every MAX reduction of the int64 shape vectors
_TIMEOUT: ContextVar[timedelta | None] = ContextVar("coreai_opt_collective_timeout", default=None)


def torch_distributed() -> ModuleType:
    """``torch.distributed``, imported on first use (``import coreai_opt`` does not pay for it)."""
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a process group is initialised."""
    dist = torch_distributed()
    return bool(dist.is_available() and dist.is_initialized())


def get_rank(group: object | None = None) -> int:
    """Rank of this process in ``group`` (0 without a process group)."""
    return int(torch_distributed().get_rank(group=group)) if is_distributed() else 0


def get_world_size(group: object | None = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return int(torch_distributed().get_world_size(group=group)) if is_distributed() else 1


def comm_device(group: object | None = None) -> torch.device:
    """The device collectives of ``group`` run on: the current CUDA device for NCCL, else the CPU."""
    backend = str(torch_distributed().get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    """Seconds or a timedelta as a timedelta (None stays None)."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def run_collective(collective: Callable[..., Any], /, *args: Any, timeout: float | timedelta | None,
                   **kwargs: Any) -> None:
    """Run the ``torch.distributed`` ``collective`` and wait at most ``timeout`` (None: blocking).

    Raises:
        RuntimeError: the collective failed or did not finish within ``timeout``.
    """
    limit = as_timedelta(timeout)
    if limit is None:
        collective(*args, **kwargs)
    else:
        collective(*args, async_op=True, **kwargs).wait(timeout=limit)


@contextmanager
def collective_timeout(timeout: float | timedelta | None) -> Iterator[None]:
    """Within the block, every collective of this module waits at most ``timeout`` (seconds or timedelta).

    ``None`` keeps the blocking behaviour (the process group timeout applies).
    """
    token = _TIMEOUT.set(as_timedelta(timeout))
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def all_reduce(tensor: Tensor, op: str, group: object | None = None) -> Tensor:
    """Elementwise reduction of ``tensor`` over the ranks of ``group``; ``tensor`` itself is not modified.

    Args:
        tensor: This rank's contribution (every rank passes the same shape and dtype).
        op: ``"sum"``, ``"min"`` or ``"max"``.
        group: Process group (default: the world).

    Returns:
        A new tensor on ``tensor``'s device, identical on every rank.
    """
    dist = torch_distributed()
    reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    buf = tensor.detach().clone().to(comm_device(group))
    run_collective(dist.all_reduce, buf, op=reduce_op, group=group, timeout=_TIMEOUT.get())
    return buf.to(tensor.device)


def all_gather(tensor: Tensor, group: object | None = None) -> list[Tensor]:
    """Every rank's ``tensor``, in rank order (every rank passes the same shape and dtype)."""
    dist = torch_distributed()
    mine = tensor.detach().contiguous().to(comm_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group=group))]
    run_collective(dist.all_gather, gathered, mine, group=group, timeout=_TIMEOUT.get())
    return [g.to(tensor.device) for g in gathered]


def agree_shape(shape: tuple[int, ...] | None, group: object | None = None, *, what: str) -> tuple[int, ...] | None:
    """The shape every rank with data reports; ``shape=None`` means "this rank has none" (see module docs).

    One MAX all-reduce of the padded shape vector and its negation.

    Args:
        shape: This rank's shape, or None when it has no statistics yet.
        group: Process group (default: the world).
        what: Name used in the error message (the calculator's ``name``).

    Returns:
        The agreed shape, or None when no rank has one.

    Raises:
        ValueError: on every rank, when ranks report different shapes.
    """
    packed = torch.full((MAX_SHAPE_RANK + 1,), -1, dtype=torch.int64)
    if shape is None:
        both = torch.cat([packed, torch.full_like(packed, _UNKNOWN)])
    else:
        if len(shape) > MAX_SHAPE_RANK:
            raise ValueError(f"{what}: statistics of rank > {MAX_SHAPE_RANK} cannot be merged, got shape {shape}")
        packed[0] = len(shape)
        packed[1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        both = torch.cat([packed, -packed])
    both = all_reduce(both, "max", group)
    high, low = both[: MAX_SHAPE_RANK + 1], -both[MAX_SHAPE_RANK + 1 :]
    if int(high[0]) < 0:
        return None
    if not torch.equal(high, low):
        raise ValueError(
            f"{what}: ranks observed tensors with different qparam shapes; every rank must feed the model inputs of "
            "the same layout (only the batch dimension may differ)"
        )
    return tuple(int(d) for d in high[1 : 1 + int(high[0])].tolist())
