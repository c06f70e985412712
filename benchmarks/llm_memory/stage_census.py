"""What a w4 KV-cache decoder export holds per stage: peak RSS, then resident anonymous / file-backed memory, the
anonymous memory ``malloc_trim`` hands back, and the live torch tensors by dtype (issue 32, Scale).

``python -m benchmarks.run llm_memory --census --layers 22`` saves a random-initialised Llama of TinyLlama's width
(:data:`benchmarks.llm_memory.decoder_memory.TINYLLAMA`; ``--layers`` sets the depth (the first one given),
``--census-vocab`` the vocabulary) and
runs the Python API in this process: ``from_pretrained`` -> ``DecoderWithCache`` -> ``prepare(capture="export")``
-> ``calibrate`` (8 stdlib-docstring prompts, prefill + decode steps) -> ``convert`` -> ``export_onnx(task=
"text-generation")``, the prepared model deleted before the export (the CLI's order). One line per stage:

* ``peak``: the highest RSS a 3 ms sampler thread saw during the stage, and as a multiple of the fp32 weights;
* ``anon`` / ``file``: resident anonymous and file-backed memory at the stage's end (the safetensors weights are
  file-backed pages once read);
* ``trimmed``: anonymous memory after ``malloc_trim(0)`` (what the allocator kept but could return);
* ``tensors``: bytes of the live torch tensors reachable by the garbage collector, by dtype (untouched
  placeholders count here but not in RSS).

Run it with ``MALLOC_MMAP_THRESHOLD_=4194304`` in the environment for what ``coreai-opt`` does to its own process
(:mod:`coreai_opt.cli.allocator`). The sampler never inspects the main thread's frames: a thread walking them while
``torch.export`` traces made the capture fail now and then (1 in 6 runs here).
"""

from __future__ import annotations

import ctypes
import gc
import json
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

__all__ = ["census"]


class _PeakSampler:
    """RSS every 3 ms in a daemon thread; :meth:`run` returns a stage's peak."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.003)

    def run(self, fn: Callable[[], Any]) -> tuple[Any, int]:
        gc.collect()
        self.peak = self.process.memory_info().rss
        result = fn()
        time.sleep(0.02)
        return result, self.peak


def _resident() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, *value = line.split()
            if key in ("RssAnon:", "RssFile:"):
                fields[key[3:-1].lower()] = int(value[0]) * 1024
    return fields


def _tensor_bytes() -> dict[str, int]:
    import torch

    storages: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = (storage.nbytes(), str(obj.dtype).removeprefix("torch."))
            except (RuntimeError, NotImplementedError):  # fake / functional tensors of a trace
                continue
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return by_dtype


def census(layers: int, vocab: int, preset: str, work_dir: Path | None) -> int:
    """Run the census (module docstring); one JSON line per stage on stdout."""
    from benchmarks.common.torchvision_ops import declare_torchvision_ops
    from benchmarks.llm_memory.decoder_memory import TINYLLAMA, make_folder

    declare_torchvision_ops()
    warnings.simplefilter("ignore")
    import coreai_opt as co
    from coreai_opt.cli import text_generation
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

    work = work_dir or Path(tempfile.mkdtemp(prefix="coreai_opt_stage_census_"))
    sizes = {**TINYLLAMA, "vocab_size": vocab}
    folder, prompts_file = make_folder(work / f"layers{layers}_vocab{vocab}" / "model", layers, sizes)
    sampler, libc, weights = _PeakSampler(), ctypes.CDLL("libc.so.6"), 1

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result, peak = sampler.run(fn)
        end = _resident()
        libc.malloc_trim(0)
        row = {"stage": name, "seconds": round(time.perf_counter() - start, 1), "peak_gb": round(peak / 1e9, 3),
               "peak_x": round(peak / weights, 3) if weights > 1 else None, "anon_gb": round(end["anon"] / 1e9, 3),
               "file_gb": round(end["file"] / 1e9, 3), "trimmed_anon_gb": round(_resident()["anon"] / 1e9, 3),
               "tensors_gb": {k: round(v / 1e9, 3) for k, v in sorted(_tensor_bytes().items()) if v > 1e6}}
        print(json.dumps(row), flush=True)
        return result

    hf = stage("load", lambda: co.from_pretrained(folder))
    weights = sum(p.numel() * 4 for p in hf.model.parameters())
    print(json.dumps({"layers": layers, "vocab": vocab, "fp32_weights_gb": round(weights / 1e9, 3)}),
          flush=True)
    decoder = DecoderWithCache(hf.model).eval()
    prompts = hf.prompt_ids(prompts_file.read_text(encoding="utf-8").splitlines())
    example = decoder.example_inputs()
    config = co.QuantizerConfig.presets.get(preset)()
    held = {"prepared": stage("prepare", lambda: co.prepare(decoder, config, example, capture="export",
                                                            dynamic_shapes=decoder.capture_dynamic_shapes()))}
    batches = decoder.calibration_batches(prompts, text_generation.DECODE_STEPS)
    stage("calibrate", lambda: co.calibrate(held["prepared"], batches, progress=False))
    converted = stage("convert", lambda: co.convert(held["prepared"]))
    held.clear()  # the prepared model goes before the export, as in the CLI
    path = folder.parent / "out" / "model.onnx"
    path.parent.mkdir(exist_ok=True)
    stage("export", lambda: co.export_onnx(converted, example, path, task="text-generation"))
    return 0
