"""``coreai-opt quantize``: quantize any model to an ONNX QDQ file and write a verification report.

Models come from ``module:factory`` (a dotted module path or a ``.py`` file, then ``:`` and a callable taking no
arguments that returns an ``nn.Module``), a TorchScript file (``.pt``, ``.pth``, ``.ts``, ``.jit``) or a
``torch.export`` file (``.pt2``). Calibration data comes from ``--calib-data`` (``.npz``: one array per model
input, in stored order; ``.pt``: a tensor or a tuple/list of tensors), each with the sample dimension first.
Without data, ``--input-shape`` calibrates on random normal data (with a warning: fine for checking the export,
meaningless for accuracy).

Outputs: ``OUTPUT.onnx``, ``OUTPUT.report.txt`` (the verification table) and ``OUTPUT.report.json``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.errors import EXIT_OK, EXIT_VERIFICATION_FAILED, CliError, one_line

if TYPE_CHECKING:
    import torch
    from torch import nn

TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".jit")
EXPORT_SUFFIX = ".pt2"
RANDOM_BATCHES = 8
VERIFY_SAMPLES = 128


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
        help="quantize a model (module:factory, TorchScript or .pt2) to ONNX QDQ and verify it",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="module:factory, path/to/file.py:factory, model.pt (TorchScript) or model.pt2")
    parser.add_argument("--calib-data", type=Path, help="calibration inputs: .npz or .pt, sample dimension first")
    parser.add_argument(
        "--input-shape",
        type=_parse_shape,
        help="shape of one batch, e.g. 1,3,224,224: checks --calib-data, or calibrates on random data without it",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="w8a8", help="QuantizerConfig preset name (default: w8a8)")
    group.add_argument("--config", type=Path, help="QuantizerConfig YAML file (instead of --preset)")
    parser.add_argument("-o", "--output", type=Path, help="output .onnx path (default: ./<model>.<preset>.onnx)")
    parser.add_argument("--batch-size", type=int, default=32, help="calibration batch size (default: 32)")
    parser.add_argument("--max-batches", type=int, help="calibrate on at most this many batches")
    parser.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's choice for the dtypes)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random calibration data (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the calibration progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    """Quantize, export and verify; write the report next to the ONNX file.

    Args:
        args: Parsed ``quantize`` arguments.

    Returns:
        0 when onnxruntime agrees with the eager quantized model, 1 otherwise.

    Raises:
        CliError: For any input the user has to fix.
    """
    if args.batch_size < 1:
        raise CliError(f"--batch-size must be >= 1, got {args.batch_size}")
    config, config_name = load_config(args.preset, args.config)
    samples = load_calibration_data(args.calib_data, args.input_shape, seed=args.seed)
    model, model_name = load_model(args.model, example_inputs=tuple(t[: args.batch_size] for t in samples))
    # Graphs loaded from TorchScript or .pt2 files may have a fixed batch size: calibrate in whole batches of it.
    static_batch = static_batch_size(model)
    batches = make_batches(samples, static_batch or args.batch_size, drop_last=static_batch is not None)
    check_inputs_fit(model, batches[0])
    if args.calib_data is None:
        print(
            f"warning: no --calib-data: calibrating on {RANDOM_BATCHES} batches of random normal data of shape "
            f"{args.input_shape}; the export is checked but the accuracy of this model means nothing",
            file=sys.stderr,
        )

    import coreai_opt as co

    prepared = co.prepare(model, config, batches[0])
    co.calibrate(prepared, batches, max_batches=args.max_batches, progress=not args.no_progress)
    converted = co.convert(prepared)

    output = args.output or Path(f"{model_name}.{config_name}.onnx")
    output.parent.mkdir(parents=True, exist_ok=True)
    output = Path(co.export_onnx(converted, batches[0], output, opset=args.opset, dynamic_batch=static_batch is None))
    verify_inputs = (
        batches[: max(1, VERIFY_SAMPLES // static_batch)]
        if static_batch
        else tuple(t[:VERIFY_SAMPLES] for t in samples)
    )
    report = co.verify_onnx(converted, output, verify_inputs)

    text_path, json_path = write_report(report, output, model=args.model, config=config_name, samples=samples)
    print(report)
    print(f"wrote {output}")
    print(f"wrote {text_path} and {json_path}")
    if not report.ok:
        print("verification FAILED: onnxruntime disagrees with the eager quantized model", file=sys.stderr)
        return EXIT_VERIFICATION_FAILED
    return EXIT_OK


def load_config(preset: str, config_path: Path | None) -> tuple[Any, str]:
    """Build the QuantizerConfig from a preset name or a YAML file.

    Args:
        preset: Name of a ``QuantizerConfig.presets`` factory (ignored when ``config_path`` is given).
        config_path: YAML file for ``QuantizerConfig.from_yaml``.

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
    names = QuantizerConfig.presets.names()
    if preset not in names:
        raise CliError(f"unknown preset {preset!r}; choose one of: {', '.join(names)}")
    return QuantizerConfig.presets.get(preset)(), preset


def load_model(spec: str, example_inputs: tuple[torch.Tensor, ...]) -> tuple[nn.Module, str]:
    """Load a model from ``module:factory``, ``file.py:factory``, a TorchScript file or a ``.pt2`` file.

    Args:
        spec: The model argument of the command line.
        example_inputs: A batch of inputs, needed to convert TorchScript to a ``torch.export`` program (whose
            batch size it fixes).

    Returns:
        ``(model, name)``: the float ``nn.Module`` (in eval mode; a graph loaded from a file keeps the mode it was
        exported in, since ``torch.export`` modules cannot switch) and a short name for default output files.

    Raises:
        CliError: Missing file, module or attribute, or a factory that does not return an ``nn.Module``.
    """
    from torch import nn

    path = Path(spec)
    if path.suffix in (*TORCHSCRIPT_SUFFIXES, EXPORT_SUFFIX):
        if not path.is_file():
            raise CliError(f"model file not found: {spec}")
        model = _load_exported(path) if path.suffix == EXPORT_SUFFIX else _load_torchscript(path, example_inputs)
        return model, path.stem
    module_part, sep, factory_name = spec.rpartition(":")
    if not sep or not module_part or not factory_name.isidentifier():
        raise CliError(
            f"cannot read model {spec!r}: expected module:factory, path/to/file.py:factory, "
            f"a TorchScript file ({', '.join(TORCHSCRIPT_SUFFIXES)}) or a torch.export file (.pt2)"
        )
    module = _import_module(module_part)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise CliError(f"{module_part!r} has no attribute {factory_name!r}")
    if not callable(factory):
        raise CliError(f"{spec!r} is not callable")
    model = factory()
    if not isinstance(model, nn.Module):
        raise CliError(f"{spec}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model.eval(), factory_name


def load_calibration_data(
    path: Path | None, input_shape: tuple[int, ...] | None, *, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Read calibration inputs (one tensor per model input, sample dimension first) or make random ones.

    Args:
        path: ``.npz`` or ``.pt`` file, or ``None`` for random data.
        input_shape: Shape of one batch; required without ``path`` (then ``RANDOM_BATCHES`` batches of random
            normal data are made), checked against the data with it.
        seed: Seed of the random data.

    Returns:
        One tensor per model input, all with the same number of samples.

    Raises:
        CliError: Missing or unreadable file, inconsistent sample counts, or a shape that contradicts
            ``input_shape``.
    """
    import torch

    if path is None:
        if input_shape is None:
            raise CliError("give --calib-data FILE (.npz or .pt) or --input-shape (e.g. 1,3,224,224)")
        generator = torch.Generator().manual_seed(seed)
        shape = (input_shape[0] * RANDOM_BATCHES, *input_shape[1:])
        return (torch.randn(shape, generator=generator),)
    if not path.is_file():
        raise CliError(f"calibration data not found: {path}")
    tensors = _read_tensors(path)
    if not tensors:
        raise CliError(f"{path} holds no arrays")
    counts = {len(t) if t.dim() else 0 for t in tensors}
    if len(counts) != 1 or 0 in counts:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise CliError(f"shape mismatch in {path}: every input needs the same number of samples first, got {shapes}")
    if input_shape is not None and tuple(tensors[0].shape[1:]) != tuple(input_shape[1:]):
        raise CliError(
            f"shape mismatch: {path} has samples of shape {tuple(tensors[0].shape[1:])} "
            f"but --input-shape gives {tuple(input_shape[1:])}"
        )
    return tensors


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


def check_inputs_fit(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    """Run the float model on one batch so that a shape or dtype mismatch fails with one clear message.

    Raises:
        CliError: The model raised on the calibration inputs.
    """
    import torch

    try:
        with torch.no_grad():
            model(*batch)
    except Exception as exc:  # noqa: BLE001 - any failure here means the data does not fit the model
        shapes = ", ".join(f"{tuple(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}" for t in batch)
        raise CliError(
            f"shape mismatch: the model rejects calibration samples of shape {shapes}: {one_line(exc)}"
        ) from None


def write_report(
    report: Any, output: Path, *, model: str, config: str, samples: tuple[torch.Tensor, ...]
) -> tuple[Path, Path]:
    """Write ``OUTPUT.report.txt`` (the verification table) and ``OUTPUT.report.json`` next to the model.

    Returns:
        The text and JSON paths.
    """
    stem = output.with_suffix("")
    text_path = stem.with_name(stem.name + ".report.txt")
    json_path = stem.with_name(stem.name + ".report.json")
    text_path.write_text(f"model: {model}\nconfig: {config}\nonnx: {output}\n\n{report}\n")
    summary = {
        "model": model,
        "config": config,
        "onnx": str(output),
        "calibration_inputs": [list(t.shape) for t in samples],
        "ok": bool(report.ok),
        "max_abs_diff": float(report.max_abs_diff),
        "argmax_agreement": None if report.argmax_agreement is None else float(report.argmax_agreement),
        "bit_exact": bool(report.bit_exact),
        "num_samples": int(report.num_samples),
        "integer_compute": dict(report.fusion.integer_compute),
        "float_compute": dict(report.fusion.float_compute),
    }
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    return text_path, json_path


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,3,224,224, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,3,224,224, got {text!r}")
    return shape


def _import_module(name: str) -> Any:
    """Import a dotted module name or a ``.py`` file path."""
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = Path(name)
        if not path.is_file():
            raise CliError(f"model file not found: {name}")
        spec = importlib.util.spec_from_file_location(f"_coreai_opt_user_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise CliError(f"cannot import {name}: not a Python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise CliError(f"cannot import module {name!r}: {exc}") from None


def _read_tensors(path: Path) -> tuple[torch.Tensor, ...]:
    """Read a ``.npz`` (arrays in stored order) or ``.pt`` (tensor, or tuple/list of tensors) file."""
    import numpy as np
    import torch

    if path.suffix == ".npz":
        try:
            with np.load(path) as data:
                return tuple(torch.from_numpy(np.ascontiguousarray(data[key])) for key in data.files)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read {path} as .npz: {one_line(exc)}") from None
    if path.suffix in (".pt", ".pth"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a bad file
            raise CliError(f"cannot read {path} with torch.load: {one_line(exc)}") from None
        items = (obj,) if isinstance(obj, torch.Tensor) else obj
        if not isinstance(items, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in items):
            raise CliError(f"{path} must hold a tensor or a tuple/list of tensors, got {type(obj).__name__}")
        return tuple(items)
    raise CliError(f"unsupported calibration file {path}: use .npz or .pt")


def _load_exported(path: Path) -> nn.Module:
    import torch

    try:
        return torch.export.load(path).module()
    except Exception as exc:  # noqa: BLE001 - a corrupt archive raises many types
        raise CliError(f"cannot load {path} with torch.export.load: {one_line(exc)}") from None


def _load_torchscript(path: Path, example_inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    """Load TorchScript and convert it to a ``torch.export`` graph, which the quantization passes can read.

    torch's own error for ``torch.export.export(script_module)`` points to ``TS2EPConverter`` for this.
    """
    import torch
    from torch._export.converter import TS2EPConverter

    try:
        script = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - a corrupt archive raises many types
        raise CliError(f"cannot load {path} with torch.jit.load: {one_line(exc)}") from None
    return TS2EPConverter(script, example_inputs).convert().module()
