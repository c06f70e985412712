"""Interleaved onnxruntime latency measurement: every variant is timed in alternation, median of all rounds.

Timing the variants one after another on a shared machine mixes machine noise into the comparison; alternating
them round by round keeps the ratios (ours / peer, fp32 / int8) meaningful even when absolute times drift. One
session is also one memory placement of the weights and buffers, which can make two identical graphs differ by a
few percent for a whole run; the rounds are therefore spread over several fresh sessions per variant.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common.onnx_utils import session


@dataclass(frozen=True)
class Timing:
    """Latency of one variant in milliseconds."""

    median_ms: float
    p90_ms: float
    runs: int
    samples: tuple[float, ...] = ()  # every run in order: round r is samples[r * runs_per_round : (r + 1) * ...]


def measure(
    models: Mapping[str, Path], feed: np.ndarray | Sequence[np.ndarray], *, threads: int, rounds: int,
    runs_per_round: int, warmup: int = 3, session_sets: int = 3,
) -> dict[str, Timing]:
    """Time each ONNX model in ``models`` on ``feed``, interleaving variants round by round.

    The ``rounds`` are split over ``session_sets`` fresh sessions per variant (each warmed up ``warmup`` runs).
    ``feed`` is one array for single-input models, or one array per graph input, in order.
    """
    arrays = [feed] if isinstance(feed, np.ndarray) else list(feed)
    labels = list(models)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    sets = max(1, min(session_sets, rounds))
    for index in range(sets):
        sessions = {label: session(path, threads) for label, path in models.items()}
        feeds = {label: dict(zip([i.name for i in s.get_inputs()], arrays, strict=True))
                 for label, s in sessions.items()}
        for label, sess in sessions.items():
            for _ in range(warmup):
                sess.run(None, feeds[label])
        for r in range(rounds * index // sets, rounds * (index + 1) // sets):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]  # rotate who goes first
            for label in order:
                sess, inputs = sessions[label], feeds[label]
                for _ in range(runs_per_round):
                    start = time.perf_counter()
                    sess.run(None, inputs)
                    samples[label].append((time.perf_counter() - start) * 1e3)
        del sessions
    return {
        label: Timing(statistics.median(s), float(np.percentile(s, 90)), len(s), tuple(s))
        for label, s in samples.items()
    }
