"""The quantized decoders scored by the study: ours (``export_onnx(..., task="text-generation")``) and
onnxruntime-genai's model builder on the same ``save_pretrained`` folder.

Ours: ``DecoderWithCache(model)`` -> ``prepare(capture="export", dynamic_shapes=...)`` -> ``calibrate`` on the
prefill and :data:`DECODE_STEPS` greedy decode steps of each calibration prompt (windows of the *training* tokens)
-> ``convert`` -> ``export_onnx(task="text-generation")``, the path of ``coreai-opt quantize --task
text-generation``. The builder runs as a subprocess of the Python that has ``onnxruntime_genai`` and its builder
dependencies (transformers, torch, onnx, onnx_ir): ``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p
PRECISION -e cpu -c CACHE``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DECODE_STEPS", "OurVariant", "OUR_VARIANTS", "Built", "build_ours", "build_with_builder", "file_bytes"]

#: Greedy decode steps calibrated after each prompt's prefill (as the CLI does).
DECODE_STEPS = 4


@dataclass(frozen=True)
class OurVariant:
    """A row of ours: its label and the preset call that builds its config."""

    label: str
    config: Callable[[], object]


def _presets() -> object:
    import coreai_opt as co

    return co.QuantizerConfig.presets


def _w4(**options: object) -> Callable[[], object]:
    return lambda: _presets().w4(**options)  # type: ignore[attr-defined]


#: Our rows, in table order. ``w4`` alone is the preset's default (GPTQ, asymmetric, block 32, float compute).
OUR_VARIANTS: tuple[OurVariant, ...] = (
    OurVariant("ours w8a8", lambda: _presets().w8a8()),  # type: ignore[attr-defined]
    OurVariant("ours w8a8_dynamic", lambda: _presets().w8a8_dynamic()),  # type: ignore[attr-defined]
    OurVariant("ours w4 (default: gptq, asym, b32)", _w4()),
    OurVariant("ours w4 rtn asym", _w4(algorithm="rtn")),
    OurVariant("ours w4 rtn sym", _w4(algorithm="rtn", qscheme="symmetric")),
    OurVariant("ours w4 hqq", _w4(algorithm="hqq")),
    OurVariant("ours w4 mse", _w4(algorithm="mse")),
    OurVariant("ours w4 gptq_mse", _w4(algorithm="gptq_mse")),
    OurVariant("ours w4 compute=int8 (acc. level 4)", _w4(compute="int8")),
    OurVariant("ours w4, embedding float", lambda: _presets().w4().set_op_kind("embedding", None)),  # type: ignore
    OurVariant("ours w4 + int8 KV cache", lambda: _presets().w4().model_copy(  # type: ignore[attr-defined]
        update={"kv_cache": _presets().int8_kv_cache()})),  # type: ignore[attr-defined]
)


@dataclass(frozen=True)
class Built:
    """An ONNX decoder on disk and how long building it took (seconds, wall)."""

    path: Path
    seconds: float

    @property
    def size(self) -> int:
        """Bytes of the file and its external data."""
        return file_bytes(self.path)


def file_bytes(path: Path) -> int:
    """Size of ``path`` plus its external-data file(s) ``path.data`` / ``path*.data`` beside it."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def build_ours(folder: Path, variant: OurVariant, prompts: list[torch.Tensor], output: Path) -> Built:
    """Quantize and export the model in ``folder`` with ``variant``'s config, calibrated on ``prompts``."""
    import coreai_opt as co
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

    start = time.perf_counter()
    hf = co.from_pretrained(folder)
    decoder = DecoderWithCache(hf.model).eval()
    example = decoder.example_inputs()
    prepared = co.prepare(decoder, variant.config(), example, capture="export",
                          dynamic_shapes=decoder.capture_dynamic_shapes())
    co.calibrate(prepared, decoder.calibration_batches(prompts, DECODE_STEPS), progress=False)
    converted = co.convert(prepared)
    output.parent.mkdir(parents=True, exist_ok=True)
    path = Path(co.export_onnx(converted, example, output, task="text-generation"))
    return Built(path, time.perf_counter() - start)


def build_with_builder(python: Path, folder: Path, precision: str, output: Path, cache: Path) -> Built:
    """Run onnxruntime-genai's model builder (``-p precision -e cpu``) with ``python``; its ``model.onnx``.

    Raises:
        RuntimeError: the builder failed (its last output lines are in the message).
    """
    output.mkdir(parents=True, exist_ok=True)
    command = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(output),
               "-p", precision, "-e", "cpu", "-c", str(cache)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    path = output / "model.onnx"
    if done.returncode != 0 or not path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"the model builder failed ({' '.join(command)}), exit {done.returncode}:\n{tail}")
    return Built(path, seconds)
