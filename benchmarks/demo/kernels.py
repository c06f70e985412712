"""Does the demo's table survive another CPU's float kernels? Emulate them and count the tables that change.

Usage::

    python -m benchmarks.run demo --ulps 64 --runs 8

Another CPU sums conv and matmul products in another order, so their outputs differ in the last bits (a few ulps).
Each run moves every float32 conv and linear output (the aten ops, caught by a ``TorchDispatchMode``) by a seeded
uniform random factor :math:`1 + u \\cdot k \\cdot 2^{-24}`, :math:`u \\in [-1, 1]`, :math:`k` = ``--ulps``, in
calibration and in every eager forward (not while the ONNX files are traced), then runs the demo on the shipped
weights and prints whether its table (latency aside) equals an unperturbed run's, the number of perturbed calls and
how far the int8 file's scales moved. onnxruntime is not perturbed (its int8 kernels sum in int32). The results
are quoted in :mod:`coreai_opt.cli.commands.demo`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import coreai_opt
from coreai_opt.cli.commands import demo

#: The aten ops whose float sums another CPU orders differently (conv, and linear as addmm / mm).
SUMMING_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.default,
                         torch.ops.aten.linear.default})


class _Perturbation(TorchDispatchMode):
    """Scales every float32 output of :data:`SUMMING_OPS` by a seeded random factor within ``ulps`` ulps."""

    def __init__(self, ulps: float, seed: int) -> None:
        super().__init__()
        self.ulps, self.generator, self.calls = ulps, torch.Generator().manual_seed(seed), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if func not in SUMMING_OPS or self.ulps == 0 or out.dtype != torch.float32:
            return out
        self.calls += 1
        u = torch.rand(out.shape, generator=self.generator) * 2 - 1
        return out * (1 + u * self.ulps * 2.0**-24)


def _scales(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT and t.name.endswith("scale")}


def run(ulps: float, seed: int, output_dir: Path) -> tuple[tuple[str, ...], int, Path]:
    """One perturbed demo run: its table rows (latency aside), the perturbed call count and its int8 file."""
    perturbation = _Perturbation(ulps, seed)
    export, export_float = coreai_opt.export_onnx, demo.export_float_onnx

    def unperturbed(function: Callable[..., Path]) -> Callable[..., Path]:
        def call(*args: object, **kwargs: object) -> Path:
            with _disable_current_modes():  # the exported graphs are traced with the real kernels
                return function(*args, **kwargs)

        return call

    try:
        coreai_opt.export_onnx, demo.export_float_onnx = unperturbed(export), unperturbed(export_float)
        with perturbation:
            result = demo.run_demo(output_dir, console=demo.Console(quiet=True))
    finally:
        coreai_opt.export_onnx, demo.export_float_onnx = export, export_float
    rows = tuple(line for line in demo.format_table(result).splitlines() if line.startswith("| ") and
                 "latency" not in line)
    return rows, perturbation.calls, result.int8_path


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options: ``--ulps`` and ``--runs``."""
    parser.add_argument("--ulps", type=float, default=64.0, help="largest move of an output, in float32 ulps")
    parser.add_argument("--runs", type=int, default=8, help="seeded runs (seeds 1000, 1001, ...)")


def main(args: argparse.Namespace) -> int:
    """Run the perturbed demos and print how many tables equal the unperturbed one."""
    with tempfile.TemporaryDirectory() as tmp:
        reference, _, reference_path = run(0.0, 0, Path(tmp) / "reference")
        reference_scales = _scales(reference_path)
        tables: Counter[tuple[str, ...]] = Counter()
        for index in range(args.runs):
            rows, calls, path = run(args.ulps, 1000 + index, Path(tmp) / f"run{index}")
            moved = max(float(np.max(np.abs(value / reference_scales[name] - 1)))
                        for name, value in _scales(path).items())
            tables[rows] += 1
            print(f"run {index}: {calls} perturbed calls, scales moved by up to {moved:.2e} (relative); "
                  f"table {'same as unperturbed' if rows == reference else 'CHANGED'}", flush=True)
    print(f"{tables[reference]} of {args.runs} tables equal the unperturbed one at up to {args.ulps:g} ulps")
    for rows, count in tables.items():
        if rows != reference:
            print(f"{count} run(s) printed:\n" + "\n".join(rows))
    return 0
