"""Run a function on N gloo ranks in spawned CPU processes, with a hard timeout so that a hang fails a test.

Each rank runs ``target(rank, world_size, *args)`` after ``dist.init_process_group("gloo")`` (TCP on
127.0.0.1, a free port, the ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` variables torchrun
sets). The return value, or the formatted exception, comes back through a queue. A rank that has not
reported within ``timeout`` seconds is killed and the run fails with an error naming it.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

#: Modules the fork server imports once (only imports: it stays single-threaded, so forking it is safe). Most are
#: imported lazily by the first prepare / export_onnx call and would otherwise cost every rank seconds.
PRELOAD = [
    "torch",
    "torch.distributed",
    "coreai_opt.api",
    "coreai_opt.onnx",
    "coreai_opt.api.distributed",
    "torch._dynamo",
    "torch.export",
    "torch.onnx._internal.exporter._core",
    "onnxscript.function_libs.torch_lib.ops",
    "onnxscript.rewriter",
    "onnx.reference",
    "networkx",
]


@dataclass
class RankResult:
    """Outcome of one rank: ``value`` when ``ok``, else ``error`` (type name + message) and ``traceback``."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    target: Callable[..., Any], rank: int, world: int, port: int, pg_timeout: float, results: Any, args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    start = time.perf_counter()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        value = target(rank, world, *args)
        # Plain pickle (not the queue's shared-memory tensor sharing): the rank may exit before the parent reads.
        results.put(pickle.dumps(RankResult(rank, True, value, seconds=time.perf_counter() - start)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put(
            pickle.dumps(
                RankResult(
                    rank,
                    False,
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(),
                    seconds=time.perf_counter() - start,
                )
            )
        )
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group (after a timeout test) may refuse a clean shutdown
                pass


class RankRun:
    """``world_size`` ranks running ``target`` in the background; :meth:`results` waits for them.

    The parent may compute its single-process reference while the ranks run (:func:`run_ranks` does not).
    """

    def __init__(
        self, target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 45.0, pg_timeout: float = 60.0
    ) -> None:
        # forkserver: one clean server process imports torch and coreai_opt once; every rank is then a cheap fork
        # of it (spawn re-imports torch per rank, which dominates the run time on small CI machines). Python
        # 3.11's forkserver ignores the parent's sys.path, so only installed packages preload reliably.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.world_size = world_size
        self.timeout = timeout
        self._queue = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_entry, args=(target, rank, world_size, port, pg_timeout, self._queue, args), daemon=True
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._deadline = time.monotonic() + timeout

    def results(self) -> list[RankResult]:
        """Results by rank. Raises ``AssertionError`` naming the ranks that did not report in time (killed)."""
        collected: dict[int, RankResult] = {}
        try:
            while len(collected) < self.world_size and time.monotonic() < self._deadline:
                try:
                    item = self._queue.get(timeout=max(0.05, min(1.0, self._deadline - time.monotonic())))
                except queue.Empty:
                    if all(not p.is_alive() for p in self._procs) and self._queue.empty():
                        break
                    continue
                result = pickle.loads(item)
                collected[result.rank] = result
        finally:
            for proc in self._procs:
                proc.join(timeout=max(0.1, min(5.0, self._deadline - time.monotonic())))
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        missing = [r for r in range(self.world_size) if r not in collected]
        if missing:
            raise AssertionError(
                f"rank(s) {missing} did not report within {self.timeout:.0f} s (hang or crash); reported: "
                + "; ".join(f"rank {r}: {'ok' if v.ok else v.error}" for r, v in sorted(collected.items()))
            )
        return [collected[r] for r in range(self.world_size)]


def run_ranks(
    target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 45.0, pg_timeout: float = 60.0
) -> list[RankResult]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` gloo ranks and wait; results by rank.

    ``target`` must be importable (a module-level function).
    """
    return RankRun(target, world_size, *args, timeout=timeout, pg_timeout=pg_timeout).results()


def values(results: list[RankResult]) -> list[Any]:
    """The values of successful ranks; fails with every rank's traceback if any rank raised."""
    failed = [r for r in results if not r.ok]
    if failed:
        raise AssertionError("\n".join(f"rank {r.rank} raised {r.error}\n{r.traceback}" for r in failed))
    return [r.value for r in results]
