"""One cell of the decoder matrix: a ``save_pretrained`` folder quantized with a preset as a KV-cache decoder file,
then greedy generation checked two ways (:mod:`coreai_opt.onnx.verify.token_flips`).

The quantization is the Python API path ``coreai-opt quantize DIR --task text-generation`` runs
(:mod:`coreai_opt.cli.text_generation`): load -> ``DecoderWithCache`` -> prepare (batch, sequence and past length
symbolic) -> calibrate on the calibration lines' prefill and 4 greedy decode steps -> convert ->
``export_onnx(..., task="text-generation")``. :func:`run_cli_cell` runs the console command itself.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.llm.families import CALIBRATION, PROMPTS
from coreai_opt.onnx.verify.token_flips import FlipReport

__all__ = ["Cell", "DECODE_STEPS", "EXTRA_PRESETS", "preset_config", "run_cell", "run_cli_cell", "file_megabytes"]

#: Greedy decode steps calibrated after each calibration prompt's prefill (as the CLI).
DECODE_STEPS = 4
#: Cells beyond the preset names: ``w8_int8`` = ``w8(compute="int8")`` (int8 activations per token and K block
#: inside ``MatMulNBits``). ``w8a8_dynamic`` is ``w8a8_dynamic(per_token=True)``, as ``--task text-generation``.
EXTRA_PRESETS = ("w8_int8",)


def preset_config(name: str) -> object:
    """The ``QuantizerConfig`` of a matrix preset name (a preset, or one of :data:`EXTRA_PRESETS`)."""
    import coreai_opt as co

    if name == "w8_int8":
        return co.QuantizerConfig.presets.w8(compute="int8")
    if name == "w8a8_dynamic":
        return co.QuantizerConfig.presets.w8a8_dynamic(per_token=True)
    return getattr(co.QuantizerConfig.presets, name)()


@dataclass
class Cell:
    """The outcome of one family x preset.

    Attributes:
        family, preset: The cell.
        error: ``"ExceptionType: message"`` when quantizing or exporting failed, else None.
        seconds: Load + prepare + calibrate + convert + export, wall time.
        megabytes: The ONNX file and its external data.
        eager_vs_ort: Eager converted model vs onnxruntime, both with the cache.
        cache_vs_no_cache: onnxruntime with the cache vs regenerating from scratch.
        bound_reason: How the logits tolerance behind the near-tie bound was derived.
        via: ``"api"`` or ``"cli"``.
    """

    family: str
    preset: str
    error: str | None = None
    seconds: float = 0.0
    megabytes: float = 0.0
    eager_vs_ort: FlipReport | None = None
    cache_vs_no_cache: FlipReport | None = None
    bound_reason: str = ""
    via: str = "api"
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exported, and both comparisons within the acceptance (near-ties only, at most 1 flip in 256)."""
        reports = (self.eager_vs_ort, self.cache_vs_no_cache)
        return self.error is None and all(r is not None and r.ok for r in reports)


def file_megabytes(path: Path) -> float:
    """Size of an ONNX file plus the external-data files beside it that it names (``<file>.data``)."""
    files = [path, *path.parent.glob(path.name + ".data")]
    return sum(f.stat().st_size for f in files if f.exists()) / 1e6


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_generation(cell: Cell, converted: object, decoder: object, path: Path, prompts: list[np.ndarray],
                     tokens: int) -> None:
    """Fill ``cell``'s two comparisons for the converted model and its file."""
    from coreai_opt.onnx.verify.generation import eager_step, ort_step
    from coreai_opt.onnx.verify.token_flips import compare_streams, logits_bound

    bound, cell.bound_reason = logits_bound(path)
    empty = [t.numpy() for t in decoder.empty_cache(1)]  # type: ignore[attr-defined]
    runtime = ort_step(_session(path))
    cell.eager_vs_ort = compare_streams(eager_step(converted), runtime, prompts, empty, tokens,  # type: ignore[arg-type]
                                        bound, "eager vs onnxruntime")
    cell.cache_vs_no_cache = compare_streams(runtime, runtime, prompts, empty, tokens, bound,
                                             "onnxruntime cache vs no cache", other_cached=False)


def run_cell(directory: Path, family: str, preset: str, work_dir: Path, prompt_count: int = 8,
             tokens: int = 32) -> Cell:
    """Quantize ``directory`` with ``preset`` through the Python API and check generation (module docstring)."""
    import coreai_opt as co
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

    cell = Cell(family, preset)
    start = time.perf_counter()
    try:
        hf = co.from_pretrained(directory, seq_len=16)
        decoder = DecoderWithCache(hf.model).eval()
        config = preset_config(preset)
        example = decoder.example_inputs()
        prepared = co.prepare(decoder, config, example, capture="export",
                              dynamic_shapes=decoder.capture_dynamic_shapes())
        co.calibrate(prepared, decoder.calibration_batches(hf.prompt_ids(CALIBRATION), DECODE_STEPS),
                     progress=False)
        converted = co.convert(prepared)
        path = Path(co.export_onnx(converted, example, work_dir / f"{family}.{preset}.onnx",
                                   task="text-generation"))
    except Exception as exc:  # the matrix reports every failure and goes on with the next cell
        cell.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        cell.details = traceback.format_exc().splitlines()[-12:]
        cell.seconds = time.perf_counter() - start
        return cell
    cell.seconds = time.perf_counter() - start
    cell.megabytes = file_megabytes(path)
    prompts = [p.numpy() for p in hf.prompt_ids(PROMPTS[:prompt_count])]
    check_generation(cell, converted, decoder, path, prompts, tokens)
    return cell


def run_cli_cell(directory: Path, family: str, preset: str, work_dir: Path) -> tuple[int, dict[str, object], float]:
    """``coreai-opt quantize DIR --task text-generation --preset PRESET --calib-text FILE``, in-process.

    Returns:
        The exit code, the ``.generation.json`` record it wrote (empty if none) and the wall time.
    """
    import json

    from coreai_opt.cli.main import main

    text = work_dir / "calibration.txt"
    text.write_text("\n".join(CALIBRATION) + "\n", encoding="utf-8")
    output = work_dir / f"{family}.{preset}.cli.onnx"
    start = time.perf_counter()
    code = main(["quantize", str(directory), "--task", "text-generation", "--preset", preset, "--calib-text",
                 str(text), "-o", str(output), "--no-progress"])
    seconds = time.perf_counter() - start
    record = output.with_suffix(".generation.json")
    return code, json.loads(record.read_text()) if record.exists() else {}, seconds
