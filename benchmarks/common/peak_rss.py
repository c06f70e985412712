"""Peak resident-memory growth of a block of code, sampled by a background thread with psutil."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil


class PeakRSS:
    """Context manager: ``peak_mb`` = highest RSS seen inside the block minus RSS at entry (MiB)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self._process = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._base = 0
        self._peak = 0
        self.peak_mb = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> PeakRSS:
        self._base = self._peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.peak_mb = (self._peak - self._base) / 2**20
