"""The ``quantize`` report: ``OUTPUT.report.txt`` (read by people) and ``OUTPUT.report.json`` (read by scripts).

Both hold the same facts: the inputs, the verification table (onnxruntime vs the eager quantized model), file
and weight sizes of the fp32 baseline and the quantized file, onnxruntime latency of both (labelled with threads,
batch and runs), the layers left float and why, the tuning steps that ran, and, in the text, a legend for every
column. Both files are written with :func:`coreai_opt.onnx.export.save.write_text_atomically`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coreai_opt.cli.measurements import Latency
from coreai_opt.onnx.export.save import write_text_atomically

__all__ = ["Sizes", "QuantizeReport", "legend", "report_paths", "write_report"]


@dataclass(frozen=True)
class Sizes:
    """Bytes on disk of the whole file and of its initializers (weights, biases, scales)."""

    file_bytes: int
    weight_bytes: int


@dataclass
class QuantizeReport:
    """Everything one ``quantize`` run measured (``verification`` is a ``VerificationReport``)."""

    model: str
    config: str
    onnx: Path
    opset: int
    inputs: list[dict[str, Any]]
    calibration: str
    verification: Any
    float_layers: list[dict[str, str]]
    fp32_sizes: Sizes | None = None
    quantized_sizes: Sizes | None = None
    fp32_latency: Latency | None = None
    quantized_latency: Latency | None = None
    baseline_note: str = ""
    tuning: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON document (plain types only)."""
        report = self.verification
        return {
            "model": self.model,
            "config": self.config,
            "onnx": str(self.onnx),
            "opset": self.opset,
            "inputs": self.inputs,
            "calibration": self.calibration,
            "calibration_inputs": [i["samples_shape"] for i in self.inputs],
            "ok": bool(report.ok),
            "max_abs_diff": float(report.max_abs_diff),
            "argmax_agreement": None if report.argmax_agreement is None else float(report.argmax_agreement),
            "bit_exact": bool(report.bit_exact),
            "num_samples": int(report.num_samples),
            "outputs": [
                {"name": o.name, "shape": list(o.shape), "max_abs_diff": o.max_abs_diff, "steps": o.max_diff_steps,
                 "argmax_agreement": o.argmax_agreement, "ok": o.ok}
                for o in report.outputs
            ],
            "integer_compute": dict(report.fusion.integer_compute),
            "float_compute": dict(report.fusion.float_compute),
            "sizes": {
                "fp32": None if self.fp32_sizes is None else vars(self.fp32_sizes),
                "quantized": None if self.quantized_sizes is None else vars(self.quantized_sizes),
            },
            "latency_ms": None if self.quantized_latency is None else {
                "fp32": None if self.fp32_latency is None else self.fp32_latency.median_ms,
                "quantized": self.quantized_latency.median_ms,
                "threads": self.quantized_latency.threads,
                "batch": self.quantized_latency.batch,
                "runs": self.quantized_latency.runs,
                "statistic": "median",
            },
            "baseline_note": self.baseline_note or None,
            "float_layers": self.float_layers,
            "tuning": self.tuning,
        }

    def text(self) -> str:
        """The text report: header, verification table, sizes, latency, float layers, tuning, legend."""
        lines = [f"model: {self.model}", f"config: {self.config}", f"onnx: {self.onnx} (opset {self.opset})",
                 "inputs: " + ", ".join(f"{i['name']} {i['dtype']} {'x'.join(map(str, i['batch_shape']))}"
                                        for i in self.inputs),
                 f"calibration: {self.calibration}", "", str(self.verification), ""]
        lines += self.size_lines() + [""]
        lines += self._float_lines()
        if self.tuning:
            lines += ["", "tuning:"] + [f"  {key}: {_tuning_text(value)}" for key, value in self.tuning.items()]
        lines += ["", legend()]
        return "\n".join(lines) + "\n"

    def size_lines(self) -> list[str]:
        """The size and latency block."""
        q, f = self.quantized_sizes, self.fp32_sizes
        lines = ["size and speed (fp32 baseline -> quantized)"]
        if q is not None:
            lines.append(f"  file size               {_kib(f.file_bytes) if f else '-'} -> {_kib(q.file_bytes)}")
            lines.append(f"  weights (initializers)  {_kib(f.weight_bytes) if f else '-'} -> {_kib(q.weight_bytes)}")
        lat, flat = self.quantized_latency, self.fp32_latency
        if lat is not None:
            lines.append(f"  latency                 {f'{flat.median_ms:.3f} ms' if flat else '-'} -> "
                         f"{lat.median_ms:.3f} ms (onnxruntime CPU, {lat.threads} thread(s), batch {lat.batch}, "
                         f"median of {lat.runs} runs)")
        if self.baseline_note:
            lines.append(f"  note: {self.baseline_note}")
        return lines

    def _float_lines(self) -> list[str]:
        if not self.float_layers:
            return ["layers left float: none"]
        rows = [("node", "module", "op kind", "reason")]
        rows += [(r["node"], r["module"] or "-", r["op_kind"], r["reason"]) for r in self.float_layers]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"layers left float ({len(self.float_layers)}):"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        return lines


def legend() -> str:
    """What every column of the report means (tolerance rules from :mod:`coreai_opt.onnx.verify.tolerance`)."""
    from coreai_opt.onnx.verify.tolerance import FLOAT_PRECISION

    return "\n".join([
        "legend",
        "  verification table (onnxruntime run of the .onnx file vs the eager quantized model, same inputs):",
        "    output        name of the ONNX graph output",
        "    shape         its shape for the first batch",
        "    max |diff|    largest |onnxruntime - eager| over every compared sample",
        "    steps         max |diff| in quantization steps of that output (the scale of the DequantizeLinear",
        "                  producing it); '-' for a float output",
        "    allowed       the tolerance derived for that output from the kernels onnxruntime runs: 0 steps",
        "                  where every op is integer or exact, one step more per quantizer behind a float",
        f"                  accumulation; float outputs of weight-only models at {FLOAT_PRECISION:g} of their range",
        "    argmax agree  share of rows whose top-1 class agrees ([N, C] outputs); near-tie flips are counted",
        "                  separately and do not fail the check",
        "    ok            within the derived tolerance; the lines below the table say which rule applied and why",
        "  fusion report (what onnxruntime's optimizer made of the file):",
        "    integer conv/matmul    convolutions and matrix products run as integer kernels (QLinearConv, QGemm...)",
        "    float conv/matmul      those left in float between DequantizeLinear and QuantizeLinear",
        "    other integer ops      other integer kernels (QLinearAdd, QLinearGlobalAveragePool, ...)",
        "    Q/DQ left              QuantizeLinear / DequantizeLinear nodes onnxruntime could not fuse away",
        "  size and speed: the fp32 baseline is the float model exported with the same inputs; latency is the",
        "    median of the stated runs after a warm-up (a short measurement: noisy on a loaded machine)",
        "  layers left float: ops whose output stays float, with the reason the quantizer placement gave",
    ])


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"


def _tuning_text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def report_paths(output: Path) -> tuple[Path, Path]:
    """``model.onnx`` -> (``model.report.txt``, ``model.report.json``)."""
    stem = output.with_suffix("")
    return stem.with_name(stem.name + ".report.txt"), stem.with_name(stem.name + ".report.json")


def write_report(report: QuantizeReport) -> tuple[Path, Path]:
    """Write both report files next to the ONNX file (atomically, never through a planted symlink)."""
    text_path, json_path = report_paths(report.onnx)
    write_text_atomically(text_path, report.text())
    write_text_atomically(json_path, json.dumps(report.to_json(), indent=2) + "\n")
    return text_path, json_path
