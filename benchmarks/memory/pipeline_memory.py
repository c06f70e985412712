"""Peak resident memory of each pipeline stage on large models, as multiples of the fp32 weights (issue 20).

Every (model, preset) runs in a fresh process, so peaks do not mix. A background thread samples the process RSS
every 3 ms (psutil) and keeps, per stage, the highest absolute RSS seen and the main thread's innermost frames at
that moment (which line of coreai_opt / torch / onnx was running at the peak). A plain float dynamo export of the
same model (``torch.onnx.export``, in a process of its own) is the reference for the export column.

Usage::

    python -m benchmarks.run memory                           # 2.4 GB four-linear model, w8a8 + float export
    python -m benchmarks.run memory --sizes 0.2 --presets w8a8 w4 --output /tmp/M.md
    python -m benchmarks.run memory --sizes --decoder --presets w8a8 w4   # a 1.1 B Llama-style decoder

Heavy: the 2.4 GB row needs about 5 GB of free memory and the decoder about 10 GB; run one at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

STAGES = ("prepare", "calibrate", "convert", "export", "verify")
#: Linear width giving about this many GB of fp32 weights with four square linears (bias included).
WIDTHS = {0.2: 3584, 0.5: 5590, 1.0: 7906, 2.4: 12288}
DEFAULT_OUTPUT = Path(__file__).with_name("RESULTS.md")
_OWN_FRAMES = ("coreai_opt", "passes", "torch", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "numpy")


class StageSampler:
    """Background RSS sampler: per named stage, the peak RSS and where the main thread was at that peak."""

    def __init__(self, interval_s: float = 0.003) -> None:
        self.process = psutil.Process()
        self.stage = "start"
        self.peaks: dict[str, int] = {}
        self.where: dict[str, list[str]] = {}
        self._interval = interval_s
        self._main = threading.main_thread().ident
        threading.Thread(target=self._run, daemon=True).start()

    def _frames(self) -> list[str]:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return []
        stack = traceback.extract_stack(frame)
        kept = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack
                if any(f"/{part}/" in f.filename for part in _OWN_FRAMES)]
        return kept[-6:]

    def _run(self) -> None:
        while True:
            rss = self.process.memory_info().rss
            stage = self.stage
            if rss > self.peaks.get(stage, 0):
                self.peaks[stage] = rss
                self.where[stage] = self._frames()
            time.sleep(self._interval)

    def run(self, stage: str, fn: Callable[[], Any], report: dict[str, Any]) -> Any:
        """Run ``fn`` as ``stage``; store seconds, peak and end RSS (bytes) and the peak's frames in ``report``."""
        gc.collect()
        self.stage = stage
        self.peaks[stage] = self.process.memory_info().rss
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        time.sleep(0.02)
        end = self.process.memory_info().rss
        report[stage] = {"seconds": seconds, "peak": max(self.peaks[stage], end), "end": end,
                         "where": self.where.get(stage, [])}
        self.stage = "between"
        return result


def linears(width: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
    """Four ``width x width`` linears (the issue's model), example input and two calibration batches."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).eval()
    batches = [(torch.randn(2, width),) for _ in range(2)]
    return model, batches[0], batches


def decoder() -> tuple[nn.Module, tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
    """A random-init Llama-style decoder of 1.1 B parameters (TinyLlama's shape) from a transformers config."""
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()  # the installed torchvision's C++ ops (transformers imports it)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         use_cache=False)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 32000, (2, 16), generator=generator),) for _ in range(2)]
    return model, batches[0], batches


class _Logits(nn.Module):
    """The decoder's logits only (export and verify compare tensors)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _weights(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def child(case: str, preset: str, work_dir: Path) -> dict[str, Any]:
    """One measured run in this process: the pipeline for ``preset``, or a float dynamo export (``"float"``)."""
    import coreai_opt as co

    warnings.simplefilter("ignore")
    sampler = StageSampler()
    report: dict[str, Any] = {"case": case, "preset": preset, "base": sampler.process.memory_info().rss}
    if case == "decoder":
        model, example, batches = decoder()
        model = _Logits(model)
    else:
        model, example, batches = linears(WIDTHS[float(case)])
    report["weights"] = _weights(model)
    path = work_dir / f"{case}_{preset}.onnx"
    if preset == "float":
        sampler.run("export", lambda: torch.onnx.export(model, example, str(path), dynamo=True, verbose=False,
                                                        external_data=True), report)
    else:
        config = co.QuantizerConfig.presets.get(preset)()
        # transformers' masking branches on the batch size: the decoder is captured and exported at a fixed shape
        fixed = case == "decoder"
        shapes = {"input_ids": None} if fixed else None
        prepared = sampler.run("prepare", lambda: co.prepare(model, config, example, capture="export" if fixed else
                                                             "auto", dynamic_shapes=shapes), report)
        sampler.run("calibrate", lambda: co.calibrate(prepared, batches, progress=False), report)
        converted = sampler.run("convert", lambda: co.convert(prepared), report)
        del prepared
        sampler.run("export", lambda: co.export_onnx(converted, example, path, dynamic_batch=not fixed), report)
        result = sampler.run("verify", lambda: co.verify_onnx(converted, path, batches[:1]), report)
        report["ok"] = bool(result.ok)
        report["integer"] = dict(result.fusion.integer_compute)
    report["file_bytes"] = sum(p.stat().st_size for p in work_dir.glob(f"{path.name}*"))
    report["overall_peak"] = max(v for k, v in sampler.peaks.items() if k != "start")
    return report


def _spawn(case: str, preset: str, work_dir: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.run", "memory", "--child", case, preset, str(work_dir)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"case": case, "preset": preset, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def _x(value: int, weights: int) -> str:
    return f"{value / weights:.2f}x"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per stage seconds and peak RSS (x fp32 weights), overall peak, float export reference."""
    floats = {r["case"]: r for r in rows if r.get("preset") == "float" and "error" not in r}
    head = ["model", "fp32 weights", "preset", *[f"{s} s / peak" for s in STAGES], "overall peak", "RSS at start",
            "float export s / peak", "export peak / float export peak", "file", "verify"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("preset") == "float":
            continue
        if "error" in r:
            lines.append(f"| {r['case']} | | {r['preset']} | error: {r['error']} |")
            continue
        w = r["weights"]
        cells = [r["case"] if r["case"] == "decoder" else f"4 linears ({r['case']} GB)", f"{w / 1e9:.2f} GB",
                 r["preset"]]
        cells += [f"{r[s]['seconds']:.1f} / {_x(r[s]['peak'], w)}" for s in STAGES]
        cells += [_x(r["overall_peak"], w), _x(r["base"], w)]
        ref = floats.get(r["case"])
        if ref:
            cells += [f"{ref['export']['seconds']:.1f} / {_x(ref['export']['peak'], w)}",
                      f"{r['export']['peak'] / ref['export']['peak']:.2f}"]
        else:
            cells += ["-", "-"]
        cells += [f"{r['file_bytes'] / 1e9:.2f} GB", f"ok={r['ok']} {r['integer']}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "- Peak = highest absolute RSS of the process during the stage (the user's model, the interpreter and the "
        "imported libraries included) divided by the fp32 weight bytes; each row is one fresh process, the float "
        "export another (`torch.onnx.export(dynamo=True, external_data=True)`).",
        "- The machine is shared: times are indicative only; memory is not affected by the load.",
    ]
    return "\n".join(lines + notes) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m benchmarks.run memory``."""
    parser.add_argument("--sizes", nargs="*", type=float, default=[2.4], choices=sorted(WIDTHS))
    parser.add_argument("--decoder", action="store_true", help="also the 1.1 B random-init Llama-style decoder")
    parser.add_argument("--presets", nargs="+", default=["w8a8"])
    parser.add_argument("--no-float", action="store_true", help="skip the float export reference")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--child", nargs=3, metavar=("CASE", "PRESET", "DIR"), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Every (case, preset) in a fresh child process (``--child``), then the table into ``args.output``."""
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], Path(args.child[2]))), flush=True)
        return 0
    cases = [str(s) for s in args.sizes] + (["decoder"] if args.decoder else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="coreai_opt_memory_") as tmp:
        for case in cases:
            for preset in ([] if args.no_float else ["float"]) + args.presets:
                work = Path(tmp) / f"{case}_{preset}"
                work.mkdir()
                rows.append(_spawn(case, preset, work))
                print(json.dumps(rows[-1]), flush=True)
                for f in work.iterdir():
                    f.unlink()
    text = "## Pipeline memory: peak RSS per stage, multiples of the fp32 weights (issue 20)\n\n" + table(rows)
    args.output.write_text(text)
    print(text)
    return 0

