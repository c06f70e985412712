"""``coreai-opt quantize``: quantize any model to an ONNX QDQ file and write a verification report.

Models: ``module:factory`` (imported with the working directory on sys.path) or ``path/to/file.py:factory``
(a callable taking no arguments that returns an nn.Module; this runs the file's code), a Hugging Face
``save_pretrained`` directory (loaded offline; needs the hf extra), a TorchScript file (.pt, .pth, .ts, .jit)
or a torch.export file (.pt2; refused when it would need an unrestricted unpickle). Model files are trusted
code: only quantize files you trust.

Calibration data (one source): ``--calib-data`` (.npz or .pt; arrays saved by name bind to the forward()
arguments of those names, unnamed ones by position; sample dimension first), ``--calib-text FILE`` (one sample a
line) or ``--calib-images DIR`` for a Hugging Face directory, or random data from ``--input
NAME:DTYPE:SHAPE[:LOW-HIGH]`` (repeatable; e.g. input_ids:int64:1,128:0-30521) or ``--input-shape`` (one float
input). Random data warns: it checks the export, not the accuracy. A Hugging Face text model exports with the
sequence length of ``--seq-len`` (only the batch dimension is dynamic).

Outputs: ``OUTPUT.onnx``, ``OUTPUT.report.txt`` (verification table, sizes, latency, layers left float, a
legend) and ``OUTPUT.report.json``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli import auto, input_specs, measurements, tuning
from coreai_opt.cli.calibration_data import build_samples, check_data_sources, check_hf_only_options
from coreai_opt.cli.console import Console
from coreai_opt.cli.model_files import EXPORT_SUFFIX, TORCHSCRIPT_SUFFIXES, load_model
from coreai_opt.cli.option_checks import check_opset_for_model, check_output_path
from coreai_opt.cli.quantize_report import QuantizeReport, Sizes, write_report
from coreai_opt.cli.text_generation import TEXT_GENERATION, check_task_options, run_text_generation
from coreai_opt.cli.usage_errors import EXIT_OK, EXIT_VERIFICATION_FAILED, CliError, one_line

if TYPE_CHECKING:
    import torch
    from torch import nn

RANDOM_BATCHES = 8
RANDOM_TEXT_SAMPLES = 32
VERIFY_SAMPLES = 128
DEFAULT_SEQ_LEN = 128
DEFAULT_LATENCY_RUNS = 20
#: ``QuantizerConfig.presets.all_names()``, listed here so that ``--help`` needs no torch import (a test keeps it
#: equal).
PRESET_NAMES = ("w8", "w4", "w8a8", "w8a8_sym", "w4a8", "w8a16", "fp8", "w8a8_dynamic")


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register the ``quantize`` subcommand.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers``.
        parents: Parsers whose options every subcommand shares.

    Returns:
        The ``quantize`` subparser.
    """
    parser = subparsers.add_parser(
        "quantize",
        parents=list(parents),
        help="quantize a model (module:factory, HF directory, TorchScript or .pt2) to ONNX QDQ and verify it",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="module:factory, path/to/file.py:factory, a save_pretrained directory, "
                        "model.pt (TorchScript) or model.pt2")
    data = parser.add_argument_group("calibration data (give one source)")
    data.add_argument("--calib-data", type=Path, help=".npz or .pt: arrays by forward() argument name (or in "
                      "order), sample dimension first")
    data.add_argument("--input", dest="inputs", action="append", type=input_specs.parse_input_spec,
                      metavar="NAME:DTYPE:SHAPE[:LOW-HIGH]", help="random data for one input, e.g. "
                      "input_ids:int64:1,128:0-30521 (repeat per input; first dimension = batch)")
    data.add_argument("--input-shape", type=_parse_shape, help="shape of one batch of a single float input, e.g. "
                      "1,3,224,224: random data, or a check of --calib-data")
    data.add_argument("--calib-text", type=Path, metavar="FILE", help="Hugging Face text model: one sample a line")
    data.add_argument("--calib-images", type=Path, metavar="DIR", help="Hugging Face image model: a folder of "
                      "images (png, jpg, bmp, webp)")
    data.add_argument("--seq-len", type=int, help=f"tokens per sample of a Hugging Face text model (default "
                      f"{DEFAULT_SEQ_LEN}); the ONNX file has this fixed sequence length")
    data.add_argument("--task", choices=[TEXT_GENERATION], help="text-generation: a Hugging Face causal LM as one "
                      "decoder with a KV cache (onnxruntime-genai's input / output names), checked by greedy "
                      "generation")
    data.add_argument("--kv-cache", choices=["float", "int8"], default="float", help="with --task text-generation: "
                      "the KV cache in float (default) or as int8 codes, one calibrated scale per head and channel "
                      "(onnxruntime's quantized GroupQueryAttention cache; a quarter of the memory)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="w8a8", metavar="NAME",
                       help=f"QuantizerConfig preset: {', '.join(PRESET_NAMES)} (default: w8a8)")
    group.add_argument("--config", type=Path, help="QuantizerConfig YAML file (instead of --preset)")
    parser.add_argument("-o", "--output", type=Path, help="output .onnx path (default: ./<model>.<preset>.onnx)")
    parser.add_argument("--batch-size", type=int, default=32, help="calibration batch size (default: 32)")
    parser.add_argument("--max-batches", type=int, help="calibrate on at most this many batches")
    parser.add_argument("--opset", type=int, help="ONNX opset, 18 to 23 (default: the lowest the model allows)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random calibration data (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the calibration progress bar (it is "
                        "only drawn when stderr is a terminal)")
    parser.add_argument("--latency-runs", type=int, default=DEFAULT_LATENCY_RUNS, help="onnxruntime runs per "
                        f"file for the fp32-vs-quantized latency (default {DEFAULT_LATENCY_RUNS}; 0 skips the "
                        "fp32 baseline export, its sizes and the latency)")
    tune = parser.add_argument_group("tuning (see README: Tuning tools)")
    tune.add_argument("--smoothquant", nargs="?", const=0.5, type=tuning.parse_alpha, metavar="ALPHA",
                      help="SmoothQuant before quantizing: migration strength in [0, 1] or 'search' (default 0.5)")
    tune.add_argument("--search-calibration", action="store_true", help="choose the activation range calculator "
                      "(minmax, percentile, mse, entropy) per quantizer by its output error")
    tune.add_argument("--keep-float-top", type=int, metavar="K", help="keep the K layers whose quantization hurts "
                      "the output most in float (measured by per-layer sensitivity)")
    tune.add_argument("--auto", action="store_true", help="choose static / dynamic / per-token int8, int16 or "
                      "float per layer by measured error and onnxruntime latency (co.auto_quantize; writes "
                      "OUTPUT.auto.txt/.json/.yaml)")
    tune.add_argument("--max-error", type=auto.parse_max_error, metavar="X", help="with --auto: the largest "
                      "relative squared output error on held-out calibration batches (default 0.002)")
    tune.add_argument("--max-latency", type=auto.parse_max_latency, metavar="US|FORMAT", help="with --auto: bound "
                      "on the estimated latency of the linears / convolutions, microseconds or a format name "
                      "(dynamic = every linear dynamic); within it the most accurate choices win when --max-error "
                      "cannot hold. Default: dynamic when --max-error is not given, else no bound")
    return parser


def run(args: argparse.Namespace) -> int:
    """Check every option, then quantize, export and verify; write the report next to the ONNX file.

    Args:
        args: Parsed ``quantize`` arguments.

    Returns:
        0 when onnxruntime agrees with the eager quantized model, 1 otherwise.

    Raises:
        CliError: For any input the user has to fix.
    """
    import coreai_opt as co

    console: Console = getattr(args, "console", None) or Console()
    _check_numbers(args)
    auto.check_auto_options(args)
    check_task_options(args)
    config, config_name = load_config(args.preset, args.config, task=args.task)
    if args.kv_cache == "int8":
        from coreai_opt.config.kv_cache_spec import int8_kv_cache

        config.kv_cache, config_name = int8_kv_cache(), f"{config_name}.kv8"
    config_name = "auto" if args.auto else config_name
    check_data_sources(args)
    output = args.output or Path(f"{default_model_name(args.model)}.{config_name}.onnx")
    check_output_path(output)

    loaded = load_model(args.model, seq_len=args.seq_len or DEFAULT_SEQ_LEN)
    check_hf_only_options(args, loaded)
    if args.task == TEXT_GENERATION:
        ok = run_text_generation(args, loaded, config, output, console)
        return EXIT_OK if ok else EXIT_VERIFICATION_FAILED
    samples, names, calibration = build_samples(args, loaded, random_batches=RANDOM_BATCHES,
                                                random_text_samples=RANDOM_TEXT_SAMPLES)
    model = loaded.ready(tuple(t[: args.batch_size] for t in samples))
    # Graphs loaded from TorchScript or .pt2 files may have a fixed batch size: calibrate in whole batches of it.
    static_batch = static_batch_size(model)
    batches = make_batches(samples, static_batch or args.batch_size, drop_last=static_batch is not None)
    if args.max_batches is not None:
        batches = batches[: args.max_batches]
    check_inputs_fit(model, batches[0], names)

    progress = console.progress and not args.no_progress
    tuning_notes: dict[str, Any] = {}
    capture = "export" if loaded.kind == "huggingface" else "auto"
    if args.smoothquant is not None:
        model, tuning_notes["smoothquant"] = tuning.smooth(model, batches, args.smoothquant)
        capture = "export"
    if args.keep_float_top:
        config, kept = tuning.keep_float_top(model, config, batches, args.keep_float_top, capture, progress)
        tuning_notes["kept float (most sensitive first)"] = kept
    random_warning = (f"no calibration data: calibrating on {calibration}; the export is checked but the accuracy "
                      "of this model means nothing") if calibration.startswith("random") else None
    outcome = None
    if args.auto:
        if random_warning:
            console.warn(random_warning)
        outcome = auto.run_auto(model, batches, args.max_error, progress, args.max_latency)
        converted, model = outcome.converted, outcome.model
        opset = check_opset_for_model(args.opset, converted, console)
        tuning_notes["auto (layers per format)"] = outcome.report.counts()
    else:
        prepared = co.prepare(model, config, batches[0], capture=capture)
        opset = check_opset_for_model(args.opset, prepared, console)
        if random_warning:
            console.warn(random_warning)
        co.calibrate(prepared, batches, progress=progress)
        if args.search_calibration:
            tuning_notes["range calculators chosen"] = tuning.search(prepared, batches)
        converted = co.convert(prepared)

    output.parent.mkdir(parents=True, exist_ok=True)
    output = Path(co.export_onnx(converted, batches[0], output, opset=opset, dynamic_batch=static_batch is None,
                                 input_names=list(names)))
    verify_inputs = (
        batches[: max(1, VERIFY_SAMPLES // static_batch)] if static_batch
        else tuple(t[:VERIFY_SAMPLES] for t in samples)
    )
    verification = co.verify_onnx(converted, output, verify_inputs)
    report = QuantizeReport(
        model=args.model, config=config_name, onnx=output, opset=opset,
        inputs=[{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "batch_shape": list(b.shape),
                 "samples_shape": list(t.shape)} for n, t, b in zip(names, samples, batches[0], strict=True)],
        calibration=calibration, verification=verification,
        float_layers=[{"node": f.node, "module": f.module, "op_kind": f.op_kind, "reason": f.reason}
                      for f in co.summary(converted).float_ops],
        tuning=tuning_notes,
    )
    _measure_baseline(report, model, batches[0], names, static_batch, args.latency_runs)
    text_path, json_path = write_report(report)
    console.info(str(verification))
    console.info()
    console.info("\n".join(report.size_lines()))
    console.info(f"layers left float: {len(report.float_layers)} (listed in the report)")
    console.info(f"wrote {output}")
    console.info(f"wrote {text_path} and {json_path}")
    if outcome is not None:
        console.info(f"wrote {', '.join(str(p) for p in auto.write_auto_files(output, outcome))}")
    if not verification.ok:
        console.warn("verification FAILED: onnxruntime disagrees with the eager quantized model")
        return EXIT_VERIFICATION_FAILED
    return EXIT_OK


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--max-batches", args.max_batches, 1),
                             ("--seq-len", args.seq_len, 1), ("--keep-float-top", args.keep_float_top, 1),
                             ("--latency-runs", args.latency_runs, 0)):
        if value is not None and value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")


def default_model_name(spec: str) -> str:
    """The short model name used in default output files (``dir/bert`` -> ``bert``, ``f.py:make`` -> ``make``)."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve().name
    if path.suffix in (*TORCHSCRIPT_SUFFIXES, EXPORT_SUFFIX):
        return path.stem
    return spec.rpartition(":")[2] or path.stem


def load_config(preset: str, config_path: Path | None, task: str | None = None) -> tuple[Any, str]:
    """Build the QuantizerConfig from a preset name or a YAML file.

    Args:
        preset: Name of a ``QuantizerConfig.presets`` factory (ignored when ``config_path`` is given).
        config_path: YAML file for ``QuantizerConfig.from_yaml``.
        task: ``--task``; with ``text-generation`` the ``w8a8_dynamic`` preset quantizes its activations per token
            (``w8a8_dynamic(per_token=True)``), so decoding with the KV cache and regenerating agree.

    Returns:
        ``(config, name)`` where ``name`` (the preset or the YAML stem) is used in default file names.

    Raises:
        CliError: Unknown preset or missing YAML file.
    """
    from coreai_opt.config import QuantizerConfig

    if config_path is not None:
        if not config_path.is_file():
            raise CliError(f"config file not found: {config_path}")
        return QuantizerConfig.from_yaml(config_path), config_path.stem
    names = QuantizerConfig.presets.all_names()
    if preset not in names:
        raise CliError(f"unknown preset {preset!r}; choose one of: {', '.join(names)}")
    if preset == "w8a8_dynamic" and task == TEXT_GENERATION:
        return QuantizerConfig.presets.w8a8_dynamic(per_token=True), preset
    return QuantizerConfig.presets.get(preset)(), preset


def static_batch_size(model: nn.Module) -> int | None:
    """Return the fixed batch size of a captured graph (``torch.export`` placeholders), or ``None`` if free.

    Example:
        >>> import torch
        >>> static_batch_size(torch.nn.Linear(2, 2)) is None
        True
    """
    import torch

    if not isinstance(model, torch.fx.GraphModule):
        return None
    for node in model.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0], int):
            return int(value.shape[0])
    return None


def make_batches(
    samples: tuple[torch.Tensor, ...], batch_size: int, *, drop_last: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """Cut the calibration samples into batches (one tuple of tensors per batch).

    Args:
        samples: One tensor per model input, sample dimension first.
        batch_size: Samples per batch.
        drop_last: Drop a final partial batch (for graphs with a fixed batch size).

    Returns:
        The batches.

    Raises:
        CliError: Fewer samples than one batch when ``drop_last`` is set.

    Example:
        >>> import torch
        >>> [b[0].shape[0] for b in make_batches((torch.zeros(5, 2),), 2)]
        [2, 2, 1]
    """
    count = len(samples[0])
    stop = count - count % batch_size if drop_last else count
    if stop == 0:
        raise CliError(f"the model has a fixed batch size of {batch_size} but the data has only {count} samples")
    return [tuple(t[i : i + batch_size] for t in samples) for i in range(0, stop, batch_size)]


_DTYPE_ERROR_WORDS = ("scalar type", "Long, Int", "dtype", "Expected object of scalar type", "must be Long")


def check_inputs_fit(model: nn.Module, batch: tuple[torch.Tensor, ...], names: tuple[str, ...] = ()) -> None:
    """Run the float model on one batch so that a shape or dtype mismatch fails with one clear message.

    Raises:
        CliError: The model raised on the calibration inputs.
    """
    import torch

    try:
        with torch.no_grad():
            model(*batch)
    except Exception as exc:  # noqa: BLE001 - any failure here means the data does not fit the model
        message = one_line(exc)
        shapes = ", ".join(f"{tuple(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}" for t in batch)
        if any(word in message for word in _DTYPE_ERROR_WORDS) and any(t.is_floating_point() for t in batch):
            named = ", ".join(f"{n} {str(t.dtype).removeprefix('torch.')}" for n, t in zip(names, batch, strict=False))
            raise CliError(
                f"dtype mismatch: the model rejects the calibration inputs ({named or shapes}): {message[:300]}; an "
                "input that holds token ids must be int64: --input NAME:int64:SHAPE:LOW-HIGH (e.g. "
                "input_ids:int64:1,128:0-30521) or an int64 array in --calib-data"
            ) from None
        raise CliError(
            f"shape mismatch: the model rejects calibration samples of shape {shapes}: {message[:300]}"
        ) from None


def _measure_baseline(report: QuantizeReport, model: nn.Module, batch: tuple[torch.Tensor, ...],
                      names: tuple[str, ...], static_batch: int | None, runs: int) -> None:
    """Fill the report's sizes and latency: quantized file always, fp32 baseline and latency unless ``runs == 0``."""
    report.quantized_sizes = Sizes(measurements.onnx_bytes(report.onnx), measurements.initializer_bytes(report.onnx))
    if runs == 0:
        report.baseline_note = "fp32 baseline and latency skipped (--latency-runs 0)"
        return
    latency_batch = [t[: static_batch or 1].numpy() for t in batch]
    report.quantized_latency = measurements.median_latency_ms(report.onnx, latency_batch, runs=runs)
    with tempfile.TemporaryDirectory(prefix="coreai_opt_fp32_") as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        try:
            measurements.export_float_onnx(model, batch, fp32, input_names=names, dynamic_batch=static_batch is None)
        except Exception as exc:  # noqa: BLE001 - the baseline is a courtesy; its failure must not fail the run
            report.baseline_note = f"the fp32 baseline did not export ({one_line(exc)[:160]})"
            return
        report.fp32_sizes = Sizes(measurements.onnx_bytes(fp32), measurements.initializer_bytes(fp32))
        report.fp32_latency = measurements.median_latency_ms(fp32, latency_batch, runs=runs)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,3,224,224, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,3,224,224, got {text!r}")
    return shape
