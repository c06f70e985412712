r"""Measure the :class:`CostTable` of this machine with onnxruntime micro-benchmarks, and cache it.

For every kernel kind (see :mod:`coreai_opt.api.algorithms.auto_quantize.cost_table`) a one-layer ONNX graph in the form
our exporter writes (``Q → DQ → Gemm/Conv ← DQ(int8 weight) → Q → DQ`` for static, the ``MatMulInteger`` form of
:mod:`coreai_opt.onnx.dynamic_matmul` for dynamic, ``MatMulNBits(bits=8, accuracy_level=4) → Add(bias)`` with the
export's block size for int8 compute) is run by onnxruntime at a few shapes; the median time ``t_i``
of each shape with ``m_i`` multiply-accumulates is fitted by least squares::

    t_i ≈ overhead + m_i / throughput          (overhead ≥ 0, throughput > 0)

The table is cached as JSON in ``$COREAI_OPT_CACHE_DIR`` (default: the user cache directory,
``~/.cache/coreai_opt`` on Linux) under a key made of the CPU model, the onnxruntime version and the thread count,
so it is measured once per machine; the same key always gives the same table, so searches are deterministic.
The file name also carries :data:`FORMAT_VERSION`, so a change of the benchmark graphs or the fit re-measures.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from coreai_opt.api.algorithms.auto_quantize.cost_table import KERNEL_KINDS, CostTable, KernelCost
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.matmul_nbits.packing import pack_matmul_nbits
from coreai_opt.quantization.spec.matmul_compute import get_matmul_compute, matmul_nbits_block_size

__all__ = ["FORMAT_VERSION", "LINEAR_SHAPES", "CONV_SHAPES", "cache_dir", "cache_path", "load_or_measure",
           "machine_key", "measure_cost_table"]

#: Version of the measurement (graphs, shapes, fit); part of the cache file name.
FORMAT_VERSION = 3
#: ``(tokens, in_features, out_features)`` timed per linear kind.
LINEAR_SHAPES: tuple[tuple[int, int, int], ...] = ((8, 32, 32), (48, 128, 128), (48, 384, 384), (48, 384, 1536),
                                                   (48, 1536, 384))
#: ``(channels_in, channels_out, side)`` of a 3x3 convolution timed per conv kind.
CONV_SHAPES: tuple[tuple[int, int, int], ...] = ((4, 4, 8), (16, 16, 16), (32, 32, 28), (64, 64, 28), (64, 128, 14))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@public_api
def machine_key(threads: int = 1) -> str:
    """``<cpu model>-ort<version>-t<threads>`` with characters other than ``[A-Za-z0-9.]`` replaced by ``_``."""
    import onnxruntime

    raw = f"{_cpu_name()}-ort{onnxruntime.__version__}-t{threads}"
    return re.sub(r"[^A-Za-z0-9.]+", "_", raw).strip("_")


@public_api
def cache_dir() -> Path:
    """``$COREAI_OPT_CACHE_DIR`` when set, else the user cache directory of coreai_opt."""
    env = os.environ.get("COREAI_OPT_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("coreai_opt"))


def _init(name: str, array: np.ndarray) -> object:
    from onnx import numpy_helper

    return numpy_helper.from_array(array, name)


def _qdq(x: str, out: str, scale: str, zp: str, nodes: list) -> None:
    from onnx import helper

    nodes += [helper.make_node("QuantizeLinear", [x, scale, zp], [f"{out}_q"]),
              helper.make_node("DequantizeLinear", [f"{out}_q", scale, zp], [out])]


def _quantized(op: str, w: np.ndarray, attrs: dict, inits: list, nodes: list) -> None:
    """``Q → DQ → op(DQ(int8 W), DQ(int32 b)) → Q → DQ`` on input ``x``, output ``y`` (the exported static form)."""
    from onnx import helper

    channels = w.shape[0]
    s_w = np.full(channels, 0.01, np.float32)
    inits += [_init("w_q", w), _init("s_w", s_w), _init("z_w", np.zeros(channels, np.int8)),
              _init("b_q", np.zeros(channels, np.int32)), _init("s_b", s_w * 0.05),
              _init("z_b", np.zeros(channels, np.int32))]
    _qdq("x", "xd", "s_x", "z_x", nodes)
    nodes += [helper.make_node("DequantizeLinear", ["w_q", "s_w", "z_w"], ["wd"], axis=0),
              helper.make_node("DequantizeLinear", ["b_q", "s_b", "z_b"], ["bd"], axis=0),
              helper.make_node(op, ["xd", "wd", "bd"], ["yf"], **attrs)]
    _qdq("yf", "y", "s_y", "z_y", nodes)


def _dynamic_linear(w: np.ndarray, inits: list, nodes: list) -> None:
    """``DynamicQuantizeLinear → MatMulInteger → Cast → Mul(s_x·s_w) → Add(b)`` (what onnxruntime fuses)."""
    from onnx import TensorProto, helper

    n = w.shape[0]
    inits += [_init("w_t", np.ascontiguousarray(w.T)), _init("s_w", np.full(n, 0.01, np.float32)),
              _init("b", np.zeros(n, np.float32))]
    nodes += [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
              helper.make_node("MatMulInteger", ["xq", "w_t", "xz"], ["acc"]),
              helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
              helper.make_node("Mul", ["xs", "s_w"], ["sc"]),
              helper.make_node("Mul", ["accf", "sc"], ["yb"]),
              helper.make_node("Add", ["yb", "b"], ["y"])]


def _int8_compute_linear(w: np.ndarray, inits: list, nodes: list) -> None:
    """``MatMulNBits(x, int8 W per block, accuracy_level=4) → Add(b)``, the block size the export writes."""
    from onnx import helper

    n, k = w.shape
    block = matmul_nbits_block_size(None, k)
    packed = pack_matmul_nbits(w.astype(np.int64), np.full((n, -(-k // block)), 0.01, np.float32), None, 8, True,
                               block)
    inits += [_init("w_nb", packed.b), _init("s_nb", packed.scales), _init("b", np.zeros(n, np.float32))]
    nodes += [helper.make_node("MatMulNBits", ["x", "w_nb", "s_nb"], ["yb"], domain="com.microsoft", K=k, N=n,
                               bits=8, block_size=block, accuracy_level=get_matmul_compute("int8").accuracy_level),
              helper.make_node("Add", ["yb", "b"], ["y"])]


def _graph(kind: str, shape: tuple[int, int, int], rng: np.random.Generator) -> tuple[object, np.ndarray, int]:
    """ONNX model, input array and MACs of one kernel kind at one shape."""
    from onnx import TensorProto, helper

    family, fmt = kind.split("_", 1)
    act = np.uint16 if fmt == "int16" else np.uint8
    zero = np.array(128 if act is np.uint8 else 32768, act)
    runtime_scaled = fmt in ("float", "dynamic", "int8_compute")  # no activation qparams in the graph
    inits = [] if runtime_scaled else [_init("s_x", np.array(0.05, np.float32)), _init("z_x", zero),
                                       _init("s_y", np.array(0.05, np.float32)), _init("z_y", zero)]
    nodes: list = []
    if family == "linear":
        m, k, n = shape
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.integers(-127, 128, (n, k)).astype(np.int8)
        op, attrs, macs, out_shape = "Gemm", {"transB": 1}, m * k * n, [m, n]
    else:
        cin, cout, side = shape
        x = rng.standard_normal((1, cin, side, side)).astype(np.float32)
        w = rng.integers(-127, 128, (cout, cin, 3, 3)).astype(np.int8)
        op, attrs, macs, out_shape = "Conv", {"pads": [1, 1, 1, 1]}, side * side * cout * cin * 9, [1, cout, side, side]
    if fmt == "float":
        inits += [_init("w", w.astype(np.float32) * 0.01), _init("b", np.zeros(w.shape[0], np.float32))]
        nodes.append(helper.make_node(op, ["x", "w", "b"], ["y"], **attrs))
    elif fmt == "dynamic":
        _dynamic_linear(w, inits, nodes)
    elif fmt == "int8_compute":
        _int8_compute_linear(w, inits, nodes)
    else:
        _quantized(op, w, attrs, inits, nodes)
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    opset = 21 if fmt == "int16" else 13
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)]
                                                 if fmt == "int8_compute" else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10 if opset == 21 else 8
    return model, x, macs


def _time_us(model: object, x: np.ndarray, threads: int, runs: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {"x": x}
    for _ in range(3):
        sess.run(None, feed)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feed)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _fit(macs: Sequence[float], times: Sequence[float]) -> KernelCost:
    """Least-squares line through ``(macs, time)``; a negative overhead is refitted through the origin."""
    m, t = np.asarray(macs, np.float64), np.asarray(times, np.float64)
    slope, overhead = np.polyfit(m, t, 1) if len(m) > 1 else (t[0] / m[0], 0.0)
    if overhead < 0.0 or slope <= 0.0:
        overhead, slope = 0.0, float((m * t).sum() / (m * m).sum())
    return KernelCost(float(overhead), float(1.0 / max(slope, 1e-12)))


@public_api
def measure_cost_table(*, threads: int = 1, runs: int = 30,
                       linear_shapes: Sequence[tuple[int, int, int]] = LINEAR_SHAPES,
                       conv_shapes: Sequence[tuple[int, int, int]] = CONV_SHAPES) -> CostTable:
    """Time every kernel kind at every shape in onnxruntime and fit one :class:`KernelCost` per kind.

    Args:
        threads: onnxruntime intra-op threads (the table prices this thread count).
        runs: Timed runs per shape (median taken).
        linear_shapes: ``(tokens, in, out)`` per linear measurement.
        conv_shapes: ``(c_in, c_out, side)`` per 3x3 convolution measurement.

    Returns:
        The fitted table, keyed by :func:`machine_key`. An int16 kind runs the float kernel between 16-bit
        ``Q → DQ`` steps, so its line is clamped to be nowhere below the float line (``overhead ≥`` the float
        overhead, ``throughput ≤`` the float throughput): a noisy fit must not make it look cheaper than float.
    """
    rng = np.random.default_rng(0)
    kernels: dict[str, KernelCost] = {}
    for kind in KERNEL_KINDS:
        shapes = linear_shapes if kind.startswith("linear") else conv_shapes
        points = [_graph(kind, shape, rng) for shape in shapes]
        kernels[kind] = _fit([p[2] for p in points], [_time_us(p[0], p[1], threads, runs) for p in points])
    for family in ("linear", "conv"):
        fit, floor = kernels[f"{family}_int16"], kernels[f"{family}_float"]
        kernels[f"{family}_int16"] = KernelCost(max(fit.overhead_us, floor.overhead_us),
                                                min(fit.macs_per_us, floor.macs_per_us))
    return CostTable(kernels, machine_key(threads))


@public_api
def cache_path(threads: int = 1, directory: Path | None = None) -> Path:
    """The cache file of this machine's table: ``<directory>/cost_table-v<FORMAT_VERSION>-<machine key>.json``.

    Args:
        threads: onnxruntime intra-op threads the table prices.
        directory: Cache folder (default :func:`cache_dir`).
    """
    return (directory or cache_dir()) / f"cost_table-v{FORMAT_VERSION}-{machine_key(threads)}.json"


@public_api
def load_or_measure(threads: int = 1, directory: Path | None = None) -> CostTable:
    """The cached table of this machine; measured (a few seconds) and written atomically when absent or unreadable.

    Args:
        threads: onnxruntime intra-op threads the table prices.
        directory: Cache folder (default :func:`cache_dir`).
    """
    key = machine_key(threads)
    path = cache_path(threads, directory)
    folder = path.parent
    try:
        table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
        if table.key == key:
            return table
    except (OSError, ValueError, KeyError, TypeError):
        pass
    table = measure_cost_table(threads=threads)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cost_table-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(table.to_dict(), handle, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return table
