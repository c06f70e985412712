"""The collectives behind every cross-rank merge of the spec layer (``all_reduce`` / ``sync_statistics``).

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
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_SHAPE_RANK", "agree_shape", "all_gather", "all_reduce", "collective_timeout", "world_size"]

#: Largest tensor rank :func:`agree_shape` exchanges.
MAX_SHAPE_RANK: int = 8

_UNKNOWN = -(2**62)  # loses every MAX reduction of the int64 shape vectors
_TIMEOUT: ContextVar[timedelta | None] = ContextVar("coreai_opt_collective_timeout", default=None)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


@contextmanager
def collective_timeout(timeout: float | timedelta | None) -> Iterator[None]:
    """Within the block, every collective of this module waits at most ``timeout`` (seconds or timedelta).

    ``None`` keeps the blocking behaviour (the process group timeout applies).
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    token = _TIMEOUT.set(timeout)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def world_size(group: object | None = None) -> int:
    """Number of ranks of ``group``."""
    return int(_dist().get_world_size(group=group))


def _device(group: object | None) -> torch.device:
    backend = str(_dist().get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _call(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    limit = _TIMEOUT.get()
    if limit is None:
        collective(*args, **kwargs)
    else:
        collective(*args, async_op=True, **kwargs).wait(timeout=limit)


def all_reduce(tensor: Tensor, op: str, group: object | None = None) -> Tensor:
    """Elementwise reduction of ``tensor`` over the ranks of ``group``; ``tensor`` itself is not modified.

    Args:
        tensor: This rank's contribution (every rank passes the same shape and dtype).
        op: ``"sum"``, ``"min"`` or ``"max"``.
        group: Process group (default: the world).

    Returns:
        A new tensor on ``tensor``'s device, identical on every rank.
    """
    dist = _dist()
    reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    buf = tensor.detach().clone().to(_device(group))
    _call(dist.all_reduce, buf, op=reduce_op, group=group)
    return buf.to(tensor.device)


def all_gather(tensor: Tensor, group: object | None = None) -> list[Tensor]:
    """Every rank's ``tensor``, in rank order (every rank passes the same shape and dtype)."""
    dist = _dist()
    mine = tensor.detach().contiguous().to(_device(group))
    gathered = [torch.empty_like(mine) for _ in range(world_size(group))]
    _call(dist.all_gather, gathered, mine, group=group)
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
