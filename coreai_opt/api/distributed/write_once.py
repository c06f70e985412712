"""Write files once (rank 0) while every rank waits and sees failures; check that all ranks hold equal tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from coreai_opt.api.distributed.process_group import (
    DistributedSyncError,
    Timeout,
    get_world_size,
    is_distributed,
    is_main_process,
    run_checked,
)
from coreai_opt.api.distributed.status import exchange_status
from coreai_opt.quantization.collectives import comm_device, torch_distributed

__all__ = ["check_synchronized", "run_on_main", "save_on_main"]

T = TypeVar("T")


def run_on_main(
    fn: Callable[..., T], *args: Any, group: object | None = None, timeout: Timeout = None, **kwargs: Any
) -> T | None:
    """Run ``fn(*args, **kwargs)`` on rank 0 only; every rank waits for it and sees its failure.

    Typical uses: ``run_on_main(coreai_opt.export_onnx, converted, example_inputs, "model.onnx")``,
    ``run_on_main(torch.save, converted.state_dict(), "model.pt")``. Without a process group ``fn`` just runs.

    Returns:
        ``fn``'s result on rank 0, ``None`` on the other ranks.

    Raises:
        DistributedSyncError: on the other ranks, when ``fn`` raised on rank 0 (which re-raises its own error).
    """
    if not is_distributed():
        return fn(*args, **kwargs)
    result: T | None = None
    error: BaseException | None = None
    if is_main_process(group):
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # reported to every rank below, then re-raised here
            error = exc
    try:
        exchange_status(group, timeout, error=error)
    except DistributedSyncError:
        if error is not None:
            raise error from None
        raise
    return result


def save_on_main(obj: Any, path: str | Path, *, group: object | None = None, timeout: Timeout = None) -> Path:
    """``torch.save(obj, path)`` on rank 0 (or ``obj(path)`` when ``obj`` is callable); all ranks wait for it.

    Returns:
        ``Path(path)`` on every rank; the file exists when the call returns.
    """
    target = Path(path)
    if callable(obj):
        run_on_main(obj, target, group=group, timeout=timeout)
    else:
        run_on_main(torch.save, obj, target, group=group, timeout=timeout)
    return target


def check_synchronized(model: nn.Module, group: object | None = None, timeout: Timeout = None) -> int:
    """Check that every parameter and buffer of ``model`` is bitwise identical on all ranks.

    Use it before exporting from rank 0 only, to be sure the other ranks would export the same bytes.

    Returns:
        The number of tensors compared (0 without a process group).

    Raises:
        DistributedSyncError: on every rank, naming the first tensor that differs.
    """
    if not is_distributed():
        return 0
    dist = torch_distributed()
    tensors = sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0])
    digests: dict[str, str] = {}
    total = hashlib.sha256()
    for name, tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = digest.hexdigest()
        total.update(digest.digest())
    device = comm_device(group)
    mine = torch.frombuffer(bytearray(total.digest()), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    run_checked(dist.all_gather, gathered, mine, group=group, timeout=timeout, what="check_synchronized")
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return len(tensors)
    per_rank: list[dict[str, str] | None] = [None] * get_world_size(group)
    dist.all_gather_object(per_rank, digests, group=group)
    names = sorted(set().union(*(d.keys() for d in per_rank if d)))
    for name in names:
        values = [None if d is None else d.get(name) for d in per_rank]
        if len(set(values)) > 1:
            differing = [r for r, v in enumerate(values) if v != values[0]]
            raise DistributedSyncError(
                f"'{name}' differs between rank 0 and rank(s) {differing}; synchronise statistics "
                "(coreai_opt.api.distributed.sync_statistics) and initialise the weights identically on every rank "
                "(same seed or load the same checkpoint) before exporting."
            )
    raise DistributedSyncError("model tensors differ across ranks")  # pragma: no cover - digest collision guard
