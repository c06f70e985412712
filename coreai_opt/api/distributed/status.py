"""The status collective that opens every sync point: error flags, model fingerprints, batch counts.

One MAX all-reduce of an int64 header ``[flag_0 .. flag_{W-1}, batches_0 .. batches_{W-1}, fp, -fp, n, -n,
active]`` (each rank fills its own slots, the others stay 0; ``MAX(v)`` and ``-MAX(-v)`` give the largest and
smallest fingerprint / quantizer count, which must agree). Only when a rank flagged an error, one
``all_gather`` of fixed-size message buffers follows, and every rank raises :class:`DistributedSyncError`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from coreai_opt.api.distributed.process_group import (
    DistributedSyncError,
    Timeout,
    get_rank,
    get_world_size,
    is_distributed,
    run_checked,
)
from coreai_opt.quantization.collectives import comm_device, torch_distributed

__all__ = ["exchange_status", "report_failure"]

_SENTINEL = -(2**62)  # "not given" in MAX reductions of int64 vectors
_MESSAGE_BYTES = 1024  # error messages are exchanged in fixed-size buffers (one collective)


class _Status(NamedTuple):
    """What the status collective of a sync point tells every rank."""

    any_active: bool  # some rank still has batches (``sync="every_batch"`` lock-step)
    batches: tuple[int, ...]  # batches each rank reported


def _encode(message: str) -> Tensor:
    data = message.encode("utf-8", errors="replace")[: _MESSAGE_BYTES - 1]
    out = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else out[:0]
    return out


def _decode(buffer: Tensor) -> str:
    raw = bytes(buffer.cpu().tolist())
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def exchange_status(
    group: object | None,
    timeout: Timeout,
    *,
    error: BaseException | str | None = None,
    fingerprint: int = _SENTINEL,
    count: int = _SENTINEL,
    active: bool = False,
    batches: int = 0,
) -> _Status:
    """The first collective of every sync point: error flags, structure check, batch counts, "any rank active".

    Returns:
        Whether any rank passed ``active=True``, and every rank's ``batches``.

    Raises:
        DistributedSyncError: a rank reported an error (all ranks raise), or ranks disagree on the fingerprint
            or the number of quantizers (all ranks raise).
    """
    dist = torch_distributed()
    world, rank = get_world_size(group), get_rank(group)
    device = comm_device(group)
    flags, counts = [0] * world, [0] * world
    flags[rank] = int(error is not None)
    counts[rank] = int(batches)
    # MAX of (v, -v) gives the largest and the smallest value over ranks; the sentinel means "not given".
    fp_pair = [fingerprint, -fingerprint] if fingerprint != _SENTINEL else [_SENTINEL, _SENTINEL]
    count_pair = [count, -count] if count != _SENTINEL else [_SENTINEL, _SENTINEL]
    header = torch.tensor([*flags, *counts, *fp_pair, *count_pair, int(active)], dtype=torch.int64, device=device)
    run_checked(dist.all_reduce, header, op=dist.ReduceOp.MAX, group=group, timeout=timeout, what="status")
    header = header.cpu()
    failed = [r for r in range(world) if int(header[r])]
    if failed:
        text = "" if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        gathered = [torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device) for _ in range(world)]
        run_checked(dist.all_gather, gathered, _encode(text).to(device), group=group, timeout=timeout,
                    what="error messages")
        details = "; ".join(f"rank {r}: {_decode(gathered[r]) or 'unknown error'}" for r in failed)
        raise DistributedSyncError(
            f"rank {rank}: calibration failed on rank(s) {failed} ({details}); every rank stops here. Fix the "
            "error on the failing rank(s) and restart all ranks."
        )
    per_rank = tuple(int(v) for v in header[world : 2 * world])
    header = header[2 * world :]
    fp_hi, fp_lo = int(header[0]), -int(header[1])
    if fingerprint != _SENTINEL and fp_hi != fp_lo:
        raise DistributedSyncError(
            f"rank {rank}: the ranks hold models with different quantizer sets (name/type fingerprints differ); "
            "every rank must prepare the same model with the same config before calibrating."
        )
    n_hi, n_lo = int(header[2]), -int(header[3])
    if count != _SENTINEL and n_hi != n_lo:
        raise DistributedSyncError(
            f"rank {rank}: ranks hold between {n_lo} and {n_hi} quantizers; prepare the same model on every rank."
        )
    return _Status(bool(int(header[4])), per_rank)


def report_failure(error: BaseException | str, group: object | None = None, timeout: Timeout = None) -> None:
    """Tell the other ranks that this rank failed, so that they raise instead of hanging.

    Call it from the failing rank where the others will next synchronise (``CalibrationSync`` does this
    for ``calibrate``); it joins their status collective and returns after it (the caller then re-raises
    its own exception). Errors that already are :class:`DistributedSyncError` were seen by every rank and
    are not reported again. No-op without a process group.
    """
    if not is_distributed() or isinstance(error, DistributedSyncError):
        return
    try:
        exchange_status(group, timeout, error=error)
    except DistributedSyncError:
        pass  # expected: the status collective reports our own failure back to us
