"""Peak memory of a TinyLlama-wide w4 KV-cache decoder export, CLI vs Python API, extrapolated to 1.1 B (issue 32).

``python -m benchmarks.run llm_memory [--layers 1 2 4] [--routes cli api]`` saves, per depth, a random-initialised
``LlamaForCausalLM`` of TinyLlama's width (hidden 2048, intermediate 5632, 32 heads / 4 KV heads, vocab 32000,
untied head) with ``save_pretrained`` (safetensors) and a byte-level BPE tokenizer trained on ``pydoc_data.topics``
(nothing downloads), plus 8 calibration prompts (stdlib docstrings, one a line). Then, each in a fresh child
process and never two at once:

* ``cli``: ``coreai-opt quantize DIR --task text-generation --preset w4 --calib-text PROMPTS -o OUT/model.onnx``,
  run in the child through :func:`coreai_opt.cli.main.main` (the console script's code, unchanged; the stage
  functions it calls are wrapped only to label the RSS samples);
* ``api``: the same job as the README writes it: ``co.from_pretrained`` -> ``DecoderWithCache`` ->
  ``co.prepare(capture="export")`` -> ``co.calibrate`` on the prompts' prefill + 4 decode steps -> ``co.convert`` ->
  ``co.export_onnx(task="text-generation")`` -> greedy generation onnxruntime vs eager (4 prompts x 32 tokens).

The child samples its RSS every 3 ms (:class:`benchmarks.memory.pipeline_memory.StageSampler`): per stage the peak,
the RSS at its end and the frames running at the peak; ``ru_maxrss`` is the kernel's own high-water mark of the
whole child. The parent stops a child whose RSS passes ``--max-rss-gb``. Peaks are divided by the fp32 weight bytes
of the model at that depth; a least-squares line ``peak_bytes = a + b * layers`` over the measured depths gives the
22-layer (1.1 B) figure, and likewise for the seconds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common.study import BENCHMARKS

__all__ = ["configure", "run", "child", "fit_line", "TINYLLAMA"]

RESULTS = BENCHMARKS / "llm_memory" / "RESULTS.md"
#: TinyLlama-1.1B's shape; ``num_hidden_layers`` is set per run (22 = 1.1 B parameters).
TINYLLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}
FULL_LAYERS = 22
#: ``--trim``: after each stage, hand the allocator's free heap back (glibc ``malloc_trim(0)``) and record the RSS.
_TRIM = {"on": False}
STAGES = ("load", "prepare", "calibrate", "convert", "export", "verify", "genai files")
PROMPTS, PROMPT_CHARS = 8, 400


def configure(parser: argparse.ArgumentParser) -> None:
    """The study's options."""
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2, 4], help="depths to measure")
    parser.add_argument("--routes", nargs="+", default=["cli", "api"], choices=["cli", "api"])
    parser.add_argument("--preset", default="w4")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model folders here (default: temp)")
    parser.add_argument("--max-rss-gb", type=float, default=12.0, help="stop a child above this RSS (default 12)")
    parser.add_argument("--output", type=Path, default=RESULTS.with_name("RESULTS.raw.jsonl"),
                        help="append one JSON line per child here (RESULTS.md is written by hand from them)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each stage and record the RSS "
                        "then (tells freed-but-kept heap from live memory)")
    parser.add_argument("--census", action="store_true", help="instead: what one API run holds per stage, in this "
                        "process, at the first --layers depth (benchmarks/llm_memory/stage_census.py)")
    parser.add_argument("--census-vocab", type=int, default=TINYLLAMA["vocab_size"])
    parser.add_argument("--child", nargs=4, metavar=("ROUTE", "PRESET", "FOLDER", "OUT"), help=argparse.SUPPRESS)


def make_folder(folder: Path, layers: int, sizes: dict[str, int] | None = None) -> tuple[Path, Path]:
    """The model folder at ``layers`` depth (tokenizer + safetensors) and its prompts file; reused when present.

    ``sizes`` replaces :data:`TINYLLAMA` (its ``num_hidden_layers`` is set to ``layers``).
    """
    import pydoc_data.topics

    from benchmarks.common.torchvision_ops import declare_torchvision_ops
    from benchmarks.llm_speed.decode_speed import make_model

    declare_torchvision_ops()  # the installed torchvision's C++ ops (transformers imports it)
    make_model(folder, {**(sizes or TINYLLAMA), "num_hidden_layers": layers})
    prompts = folder.parent / "prompts.txt"
    if not prompts.exists():
        texts = list(pydoc_data.topics.topics.values())[:PROMPTS]
        prompts.write_text("".join(" ".join(t[:PROMPT_CHARS].split()) + "\n" for t in texts), encoding="utf-8")
    return folder, prompts


def _stage(sampler: Any, stage: str, fn: Callable[[], Any], report: dict[str, Any], log: Path) -> Any:
    """``sampler.run(stage, fn, report)``, noting the stage's start and end in ``log`` (to follow a long child)."""
    with log.open("a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} start {stage} rss {sampler.process.memory_info().rss / 1e9:.2f} GB\n")
    result = sampler.run(stage, fn, report)
    if _TRIM["on"]:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        report[stage]["trimmed"] = sampler.process.memory_info().rss
    with log.open("a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} end {stage} peak {report[stage]['peak'] / 1e9:.2f} GB "
                f"{report[stage]['where'][-2:]} trimmed {report[stage].get('trimmed', 0) / 1e9:.2f} GB\n")
    return result


def _label(sampler: Any, report: dict[str, Any], owner: Any, name: str, stage: str, log: Path) -> None:
    """Wrap ``owner.name`` so that each call runs as ``stage`` of ``sampler`` (the first call's figures kept)."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - a transparent wrapper
        if stage in report:
            return inner(*args, **kwargs)
        return _stage(sampler, stage, lambda: inner(*args, **kwargs), report, log)

    setattr(owner, name, wrapped)


def _weights(model: Any) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def child(route: str, preset: str, folder: Path, out: Path) -> dict[str, Any]:
    """One measured run in this process (module docstring); the report of seconds and bytes per stage."""
    import coreai_opt as co
    from benchmarks.common.torchvision_ops import declare_torchvision_ops
    from benchmarks.memory.pipeline_memory import StageSampler
    from coreai_opt.cli import text_generation
    from coreai_opt.cli.commands import quantize
    from coreai_opt.onnx.export import genai_config
    from coreai_opt.onnx.verify import generation

    declare_torchvision_ops()
    warnings.simplefilter("ignore")
    sampler = StageSampler()
    report: dict[str, Any] = {"route": route, "preset": preset, "folder": str(folder),
                              "base": sampler.process.memory_info().rss}
    start = time.perf_counter()
    log = out / "stages.log"
    if route == "cli":
        from coreai_opt.cli.main import main

        load = quantize.load_model

        def load_and_weigh(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            loaded = load(*args, **kwargs)
            report["weights"] = _weights(loaded.pretrained.model)
            return loaded

        quantize.load_model = load_and_weigh
        _label(sampler, report, quantize, "load_model", "load", log)
        for name, stage in (("prepare", "prepare"), ("calibrate", "calibrate"), ("convert", "convert"),
                            ("export_onnx", "export")):
            _label(sampler, report, co, name, stage, log)
        _label(sampler, report, generation, "compare_greedy", "verify", log)
        _label(sampler, report, genai_config, "write_genai_files", "genai files", log)
        code = main(["quantize", str(folder), "--task", "text-generation", "--preset", preset, "--calib-text",
                     str(folder.parent / "prompts.txt"), "-o", str(out / "model.onnx"), "--no-progress", "-q"])
        report["ok"] = code == 0
    else:
        from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

        hf = _stage(sampler, "load", lambda: co.from_pretrained(folder), report, log)
        report["weights"] = _weights(hf.model)
        decoder = DecoderWithCache(hf.model).eval()
        lines = (folder.parent / "prompts.txt").read_text(encoding="utf-8").splitlines()
        prompts = hf.prompt_ids(lines)
        example = decoder.example_inputs()
        config = co.QuantizerConfig.presets.get(preset)()
        shapes = decoder.capture_dynamic_shapes()
        prepared = _stage(sampler, "prepare", lambda: co.prepare(decoder, config, example, capture="export",
                                                                 dynamic_shapes=shapes), report, log)
        batches = decoder.calibration_batches(prompts, text_generation.DECODE_STEPS)
        _stage(sampler, "calibrate", lambda: co.calibrate(prepared, batches, progress=False), report, log)
        converted = _stage(sampler, "convert", lambda: co.convert(prepared), report, log)
        del prepared
        path = out / "model.onnx"
        _stage(sampler, "export", lambda: co.export_onnx(converted, example, path, task="text-generation"), report, log)
        result = _stage(sampler, "verify", lambda: generation.compare_greedy(
            converted, path, prompts[:text_generation.CHECK_PROMPTS], decoder.empty_cache(1),
            text_generation.CHECK_TOKENS), report, log)
        report["ok"] = bool(result.ok)
    report["seconds"] = time.perf_counter() - start
    report["file_bytes"] = sum(p.stat().st_size for p in out.glob("model.onnx*"))
    report["overall_peak"] = max(v for k, v in sampler.peaks.items() if k != "start")
    report["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def _spawn(route: str, preset: str, folder: Path, out: Path, max_rss: float, trim: bool) -> dict[str, Any]:
    """Run one child; poll its RSS every 0.5 s and stop it (its pid only) above ``max_rss`` bytes."""
    command = [sys.executable, "-m", "benchmarks.run", "llm_memory", "--child", route, preset, str(folder), str(out)]
    command += ["--trim"] if trim else []
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
        watched, highest = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                highest = max(highest, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if highest > max_rss:
                proc.kill()
                proc.wait()
                return {"route": route, "folder": str(folder), "error": f"stopped at {highest / 1e9:.2f} GB RSS"}
            time.sleep(0.5)
        stdout.seek(0)
        stderr.seek(0)
        lines = [line for line in stdout.read().splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            return {"route": route, "folder": str(folder),
                    "error": (stderr.read().strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    r"""Least-squares ``y = a + b x``: :math:`b = \sum (x - \bar x)(y - \bar y) / \sum (x - \bar x)^2`, ``a = ȳ - b x̄``.

    Example:
        >>> fit_line([1, 2, 4], [3, 5, 9])
        (1.0, 2.0)
    """
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def full_weights() -> int:
    """fp32 bytes of the 22-layer model, from the config alone (embedding + head + 22 layers + final norm)."""
    h, i, v = TINYLLAMA["hidden_size"], TINYLLAMA["intermediate_size"], TINYLLAMA["vocab_size"]
    kv = h * TINYLLAMA["num_key_value_heads"] // TINYLLAMA["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 4 * (2 * v * h + FULL_LAYERS * layer + h)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (depth, route) seconds / peak (x fp32 weights) per stage, overall, ru_maxrss, CLI / API."""
    head = ["layers", "fp32 weights", "route", *[f"{s} s / peak" for s in STAGES], "total s", "overall peak",
            "ru_maxrss", "file", "ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('layers', '?')} | | {r['route']} | error: {r['error']} |")
            continue
        w = r["weights"]
        cells = [str(r["layers"]), f"{w / 1e9:.2f} GB", r["route"]]
        cells += [f"{r[s]['seconds']:.0f} / {r[s]['peak'] / w:.2f}x" if s in r else "-" for s in STAGES]
        cells += [f"{r['seconds']:.0f}", f"{r['overall_peak'] / w:.2f}x ({r['overall_peak'] / 1e9:.2f} GB)",
                  f"{r['ru_maxrss'] / w:.2f}x", f"{r['file_bytes'] / 1e9:.2f} GB", str(r["ok"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def extrapolation(rows: list[dict[str, Any]]) -> str:
    """Per route: the fits of peak bytes and seconds over the depths, and their 22-layer value."""
    out = []
    for route in ("cli", "api"):
        done = [r for r in rows if r["route"] == route and "error" not in r]
        if len({r["layers"] for r in done}) < 2:
            continue
        xs = [float(r["layers"]) for r in done]
        a, b = fit_line(xs, [r["overall_peak"] / 1e9 for r in done])
        ta, tb = fit_line(xs, [r["seconds"] for r in done])
        full = a + b * FULL_LAYERS
        out.append(f"- {route}: peak = {a:.2f} GB + {b:.3f} GB x layers -> 22 layers: {full:.2f} GB = "
                   f"{full * 1e9 / full_weights():.2f}x of {full_weights() / 1e9:.2f} GB (extrapolated); "
                   f"time = {ta:.0f} s + {tb:.0f} s x layers -> {ta + tb * FULL_LAYERS:.0f} s (extrapolated)")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    """Every (depth, route) in a fresh child, one at a time; JSON lines into ``--output``, the table to stdout."""
    if args.census:
        from benchmarks.llm_memory.stage_census import census

        return census(args.layers[0], args.census_vocab, args.preset, args.work_dir)
    if args.child:
        route, preset, folder, out = args.child
        _TRIM["on"] = args.trim
        print(json.dumps(child(route, preset, Path(folder), Path(out))), flush=True)
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="coreai_opt_llm_memory_"))
    rows = []
    for layers in args.layers:
        folder, _ = make_folder(work / f"layers{layers}" / "model", layers)
        for route in args.routes:
            out = work / f"layers{layers}" / route
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            row = {**_spawn(route, args.preset, folder, out, args.max_rss_gb * 1e9, args.trim), "layers": layers}
            rows.append(row)
            with args.output.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            for written in out.iterdir():  # the files (GBs); stages.log stays to read
                if written.is_dir():
                    shutil.rmtree(written)
                elif written.name != "stages.log":
                    written.unlink()
    print(table(rows) + "\n" + extrapolation(rows))
    return 0
