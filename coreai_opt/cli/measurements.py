"""File sizes and onnxruntime latency of an fp32 baseline and a quantized ONNX file (used by demo and quantize).

Latency is the median wall time of ``session.run`` after a warm-up, in one onnxruntime CPU session with
``threads`` intra- and inter-op threads, always on the same batch. It is a short measurement: on a loaded
machine it says which file is faster, not by how much to the percent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import onnxruntime as ort
    import torch

__all__ = ["Latency", "onnx_bytes", "initializer_bytes", "session", "median_latency_ms", "export_float_onnx"]


@dataclass(frozen=True)
class Latency:
    """Median latency of one file and how it was measured."""

    median_ms: float
    threads: int
    batch: int
    runs: int


def onnx_bytes(path: Path) -> int:
    """Size of an ONNX model on disk, including its external-data file if there is one."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def initializer_bytes(path: Path) -> int:
    """Serialized size of the model's initializers (weights, biases, scales, zero points)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    external = sum(int(e.value) for t in model.graph.initializer for e in t.external_data if e.key == "length")
    return sum(t.ByteSize() for t in model.graph.initializer) + external


def session(path: Path, threads: int | None) -> ort.InferenceSession:
    """Open a CPU onnxruntime session; ``threads`` pins intra- and inter-op threads (None: onnxruntime's choice)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_latency_ms(path: Path, inputs: Sequence[np.ndarray], *, threads: int = 1, warmup: int = 5,
                      runs: int = 20) -> Latency:
    """Median time of one ``session.run`` on ``inputs`` (one array per graph input, in order)."""
    sess = session(path, threads)
    feed = {i.name: x for i, x in zip(sess.get_inputs(), inputs, strict=True)}
    for _ in range(warmup):
        sess.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        sess.run(None, feed)
        times.append(time.perf_counter_ns() - start)
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].ndim else 1
    return Latency(statistics.median(times) / 1e6, threads, batch, runs)


def export_float_onnx(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], path: Path, *,
                      input_names: Sequence[str] | None = None, dynamic_batch: bool = True) -> Path:
    """Export the float model with the dynamo exporter to one file: the fp32 baseline."""
    import onnx
    import torch

    from coreai_opt.onnx.export.export_onnx import strip_debug_metadata

    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} if t.dim() else None for t in example_inputs)
    program = torch.onnx.export(model, tuple(example_inputs), dynamo=True, dynamic_shapes=dynamic_shapes,
                                input_names=list(input_names) if input_names else None, verbose=False)
    model_proto = program.model_proto
    strip_debug_metadata(model_proto)  # as export_onnx does: sizes compare like with like, bytes do not carry paths
    onnx.save_model(model_proto, str(path))
    return path
