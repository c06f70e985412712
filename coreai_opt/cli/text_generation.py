"""``coreai-opt quantize DIR --task text-generation``: a Hugging Face causal LM as one KV-cache decoder file.

Recipe: wrap the loaded model in :class:`~coreai_opt.graph.kv_cache_decoder.DecoderWithCache` -> capture it with
batch, sequence and past length symbolic -> calibrate on each prompt's prefill and a few greedy decode steps, at
its real length (``--calib-text`` lines, else random ids of ``--seq-len`` tokens) -> convert ->
``export_onnx(..., task="text-generation")`` -> greedy generation in onnxruntime vs eager, token for token
(:mod:`coreai_opt.onnx.verify.generation`). Writes ``OUTPUT.onnx``, ``OUTPUT.generation.json``, and beside them
``genai_config.json`` and the tokenizer (:mod:`coreai_opt.onnx.export.genai_config`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from coreai_opt.cli.console import Console
from coreai_opt.cli.usage_errors import CliError

__all__ = ["TEXT_GENERATION", "DECODE_STEPS", "CHECK_PROMPTS", "CHECK_TOKENS", "check_task_options",
           "run_text_generation"]

TEXT_GENERATION = "text-generation"
#: Greedy decode steps calibrated after each prompt's prefill.
DECODE_STEPS = 4
#: Prompts (the first calibration ones) and tokens per prompt of the generation check.
CHECK_PROMPTS = 4
CHECK_TOKENS = 32


def check_task_options(args: argparse.Namespace) -> None:
    """Refuse the options ``--task text-generation`` does not take (data sources and tuning of the plain path).

    Raises:
        CliError: Naming the option to drop.
    """
    if args.task != TEXT_GENERATION:
        if getattr(args, "kv_cache", "float") != "float":
            raise CliError(f"--kv-cache {args.kv_cache} quantizes a decoder's KV cache; it needs --task "
                           f"{TEXT_GENERATION} (a Hugging Face causal LM directory)")
        return
    given = [flag for flag, value in (("--calib-data", args.calib_data), ("--input", args.inputs),
                                      ("--input-shape", args.input_shape), ("--calib-images", args.calib_images),
                                      ("--smoothquant", args.smoothquant), ("--auto", args.auto or None),
                                      ("--search-calibration", args.search_calibration or None),
                                      ("--keep-float-top", args.keep_float_top)) if value is not None]
    if given:
        raise CliError(f"--task {TEXT_GENERATION} calibrates on --calib-text prompts with the preset or --config "
                       f"only; drop {', '.join(given)}")


def _prompts(args: argparse.Namespace, hf: Any, console: Console) -> tuple[list[torch.Tensor], str]:
    if args.calib_text is not None:
        lines = [line for line in args.calib_text.read_text(encoding="utf-8").splitlines() if line.strip()]
        return hf.prompt_ids(lines), f"{args.calib_text} ({len(lines)} prompts, prefill + {DECODE_STEPS} decode steps)"
    generator = torch.Generator().manual_seed(args.seed)
    console.warn(f"no calibration text: calibrating on random prompts of {hf.seq_len} token ids; the export is "
                 "checked but the accuracy of this model means nothing")
    prompts = [torch.randint(0, hf.vocab_size, (hf.seq_len,), generator=generator) for _ in range(8)]
    return prompts, f"8 random prompts of {hf.seq_len} token ids"


def run_text_generation(args: argparse.Namespace, loaded: Any, config: Any, output: Path, console: Console) -> bool:
    """Quantize, export and check the decoder (module docstring); True when the generated tokens agree.

    Raises:
        CliError: The model is not a Hugging Face causal LM directory.
    """
    import coreai_opt as co
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache
    from coreai_opt.huggingface import is_causal_lm
    from coreai_opt.onnx.export.genai_config import write_genai_files
    from coreai_opt.onnx.verify.generation import compare_greedy

    hf = loaded.pretrained
    if hf is None or not is_causal_lm(hf.architecture):
        what = hf.architecture if hf is not None else args.model
        raise CliError(f"--task {TEXT_GENERATION} needs a Hugging Face save_pretrained directory of a causal LM "
                       f"(architectures: *ForCausalLM, GPT2LMHeadModel, ...), got {what}")
    decoder = DecoderWithCache(hf.model).eval()
    prompts, calibration = _prompts(args, hf, console)
    example = decoder.example_inputs()
    prepared = co.prepare(decoder, config, example, capture="export", dynamic_shapes=decoder.capture_dynamic_shapes())
    co.calibrate(prepared, decoder.calibration_batches(prompts, DECODE_STEPS),
                 progress=console.progress and not args.no_progress)
    converted = co.convert(prepared)
    output.parent.mkdir(parents=True, exist_ok=True)
    path = Path(co.export_onnx(converted, example, output, opset=args.opset, task=TEXT_GENERATION))
    report = compare_greedy(converted, path, prompts[:CHECK_PROMPTS], decoder.empty_cache(1), CHECK_TOKENS)
    record = {"task": TEXT_GENERATION, "model": args.model, "onnx": str(path), "calibration": calibration,
              "ok": report.ok, "tokens_identical": report.identical, "tokens": report.total,
              "first_difference": report.first_difference, "margins": report.margins,
              "onnxruntime_tokens": report.onnxruntime, "eager_tokens": report.eager}
    json_path = path.with_suffix(".generation.json")
    json_path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    console.info(str(report))
    console.info(f"calibration: {calibration}")
    console.info(f"wrote {path}")
    console.info(f"wrote {json_path}")
    written = write_genai_files(path, hf.model.config, hf.preprocessor)
    console.info(f"wrote {', '.join(p.name for p in written)} beside it (onnxruntime_genai.Model({path.parent}))")
    return report.ok
