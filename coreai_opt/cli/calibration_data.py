"""Calibration inputs of ``coreai-opt quantize``: where they come from, and how they bind to ``forward()`` by name.

Sources (one per run): a data file, ``--input`` specs or ``--input-shape`` (random data), or for a Hugging Face
directory ``--calib-text`` / ``--calib-images`` (or random token ids / pixels without either).

* ``.npz``: arrays saved by name (``np.savez(f, input_ids=..., attention_mask=...)``) bind to the forward()
  arguments of those names, in forward() order, whatever order the file stores them in. Arrays saved without
  names (``np.savez(f, a, b)``: keys ``arr_0``, ``arr_1``) bind by position.
* ``.pt``: a dict of tensors binds by name like an ``.npz``; a tensor or a tuple/list of tensors by position.

Every tensor has the sample dimension first. Inputs are passed to the model by position, so the named inputs
must be the first forward() arguments: one left out before a given one is an error, as is an unknown name or a
missing required argument.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.input_specs import random_inputs
from coreai_opt.cli.model_files import LoadedModel, forward_inputs
from coreai_opt.cli.usage_errors import CliError, one_line

if TYPE_CHECKING:
    import torch

__all__ = ["read_named_tensors", "bind_to_forward", "check_sample_counts", "check_data_sources",
           "check_hf_only_options", "build_samples"]

_POSITIONAL_KEY = re.compile(r"arr_(\d+)")


def read_named_tensors(path: Path) -> tuple[list[str] | None, tuple[torch.Tensor, ...]]:
    """Read a calibration file: ``(names or None for positional data, tensors)``.

    Raises:
        CliError: Missing, unreadable or empty file, or contents that are not tensors.
    """
    import numpy as np
    import torch

    if not path.is_file():
        raise CliError(f"calibration data not found: {path}")
    if path.suffix == ".npz":
        try:
            with np.load(path) as data:
                keys = list(data.files)
                arrays = {key: torch.from_numpy(np.ascontiguousarray(data[key])) for key in keys}
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read {path} as .npz: {one_line(exc)}") from None
        if not keys:
            raise CliError(f"{path} holds no arrays")
        positional = [_POSITIONAL_KEY.fullmatch(k) for k in keys]
        if all(positional):
            order = sorted(keys, key=lambda k: int(_POSITIONAL_KEY.fullmatch(k).group(1)))
            return None, tuple(arrays[k] for k in order)
        if any(positional):
            raise CliError(f"{path} mixes named arrays and unnamed ones ({', '.join(keys)}); save all of them by "
                           "forward() argument name: np.savez(f, input_ids=..., attention_mask=...)")
        return keys, tuple(arrays[k] for k in keys)
    if path.suffix in (".pt", ".pth"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a bad file
            raise CliError(f"cannot read {path} with torch.load: {one_line(exc)[:300]}") from None
        if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
            if not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise CliError(f"{path} holds a dict whose values are not all tensors")
            return list(obj), tuple(obj.values())
        items = (obj,) if isinstance(obj, torch.Tensor) else obj
        if not isinstance(items, (tuple, list)) or not items or not all(isinstance(t, torch.Tensor) for t in items):
            raise CliError(f"{path} must hold a tensor, a tuple/list of tensors or a dict of tensors by input "
                           f"name, got {type(obj).__name__}")
        return None, tuple(items)
    raise CliError(f"unsupported calibration file {path}: use .npz or .pt")


def bind_to_forward(
    names: list[str] | None,
    tensors: tuple[torch.Tensor, ...],
    forward: tuple[tuple[str, ...], int] | None,
    source: str,
) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...]]:
    """Order ``tensors`` as the model's forward() arguments.

    Args:
        names: Input names of the tensors, or None for positional data.
        tensors: One tensor per input.
        forward: ``(forward() argument names, number required)`` or None when the model takes ``*args``.
        source: What the data came from, for messages (a file name or ``--input``).

    Returns:
        ``(tensors in forward() order, their names)``; positional data gets forward()'s first names (or
        ``input_0``, ... when forward() takes ``*args``).

    Raises:
        CliError: Unknown names, a skipped argument, missing required arguments, or more positional inputs than
            forward() takes.

    Example:
        >>> import torch
        >>> a, m = torch.zeros(2, 3), torch.ones(2, 3)
        >>> bind_to_forward(["attention_mask", "input_ids"], (m, a), (("input_ids", "attention_mask"), 1), "f")[1]
        ('input_ids', 'attention_mask')
    """
    if forward is None:
        if names is not None:
            raise CliError(f"{source} names its inputs ({', '.join(names)}) but the model's forward() takes *args, "
                           "so names cannot be matched; store the arrays without names, in order")
        return tensors, tuple(f"input_{i}" for i in range(len(tensors)))
    params, required = forward
    if names is None:
        if len(tensors) > len(params):
            raise CliError(f"{source} has {len(tensors)} inputs but forward() takes {len(params)} "
                           f"({', '.join(params)})")
        bound = params[: len(tensors)]
    else:
        unknown = [n for n in names if n not in params]
        if unknown:
            raise CliError(f"{source} has inputs {', '.join(unknown)} that are not forward() arguments; the model "
                           f"takes {', '.join(params)}; rename them")
        by_name = dict(zip(names, tensors, strict=True))
        last = max(params.index(n) for n in names)
        skipped = [p for p in params[:last] if p not in by_name]
        if skipped:
            raise CliError(f"{source} gives {params[last]} but not {', '.join(skipped)}, which forward() takes "
                           "before it; inputs are passed by position, so add them")
        bound = params[: last + 1]
        tensors = tuple(by_name[p] for p in bound)
    missing = list(params[len(bound) : required])
    if missing:
        raise CliError(f"{source} lacks the required forward() argument(s) {', '.join(missing)}; the model takes "
                       f"{', '.join(params)}")
    return tensors, tuple(bound)


def check_sample_counts(tensors: tuple[torch.Tensor, ...], names: tuple[str, ...], source: str) -> None:
    """Every input needs the same (non-zero) number of samples along dimension 0.

    Raises:
        CliError: The counts differ or an input is a scalar.
    """
    counts = {len(t) if t.dim() else 0 for t in tensors}
    if len(counts) != 1 or 0 in counts:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
        raise CliError(f"shape mismatch in {source}: every input needs the same number of samples first, got "
                       f"{shapes}")


def check_data_sources(args: argparse.Namespace) -> None:
    """Refuse two data sources at once and missing data files or folders, before the model loads."""
    given = [flag for flag, value in (("--calib-data", args.calib_data), ("--input", args.inputs),
                                      ("--calib-text", args.calib_text), ("--calib-images", args.calib_images))
             if value]
    if len(given) > 1:
        raise CliError(f"give one calibration source, got {' and '.join(given)}")
    if args.inputs and args.input_shape is not None:
        raise CliError("--input-shape describes a single float input; with --input give every input as "
                       "NAME:DTYPE:SHAPE[:LOW-HIGH] instead")
    if args.calib_data is not None and not args.calib_data.is_file():
        raise CliError(f"calibration data not found: {args.calib_data}")
    if args.calib_text is not None and not args.calib_text.is_file():
        raise CliError(f"calibration text file not found: {args.calib_text}")
    if args.calib_images is not None and not args.calib_images.is_dir():
        raise CliError(f"calibration image folder not found: {args.calib_images}")


def check_hf_only_options(args: argparse.Namespace, loaded: LoadedModel) -> None:
    """Refuse --calib-text / --calib-images / --seq-len for a model that is not a Hugging Face directory."""
    if loaded.kind == "huggingface":
        return
    for flag, value in (("--calib-text", args.calib_text), ("--calib-images", args.calib_images),
                        ("--seq-len", args.seq_len)):
        if value is not None:
            raise CliError(f"{flag} works with a Hugging Face save_pretrained directory; for {args.model} use "
                           "--calib-data FILE or --input NAME:DTYPE:SHAPE[:LOW-HIGH]")


def build_samples(args: argparse.Namespace, loaded: LoadedModel, *, random_batches: int, random_text_samples: int
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...], str]:
    """Calibration samples in forward() order, their input names and a description of where they came from.

    Args:
        args: The parsed ``quantize`` arguments (the data options and ``seed``).
        loaded: The model; its forward() names the inputs.
        random_batches: Batches of random data made from ``--input`` / ``--input-shape``.
        random_text_samples: Samples of random data for a Hugging Face model without calibration files.

    Raises:
        CliError: No data source, unreadable data, or data that does not match the model's forward().
    """
    import torch

    forward = forward_inputs(loaded.module)
    hf = loaded.pretrained
    if args.calib_data is not None:
        names, tensors = read_named_tensors(args.calib_data)
        labels = tuple(names or (f"array {i}" for i in range(len(tensors))))
        check_sample_counts(tensors, labels, str(args.calib_data))
        tensors, bound = bind_to_forward(names, tensors, forward, str(args.calib_data))
        if args.input_shape is not None and tuple(tensors[0].shape[1:]) != tuple(args.input_shape[1:]):
            raise CliError(f"shape mismatch: {args.calib_data} has samples of shape {tuple(tensors[0].shape[1:])} "
                           f"but --input-shape gives {tuple(args.input_shape[1:])}")
        return tensors, bound, f"{args.calib_data} ({len(tensors[0])} samples)"
    if args.inputs:
        names = [spec.name for spec in args.inputs]
        if len(set(names)) != len(names):
            raise CliError(f"--input names repeat: {', '.join(names)}; give each input once")
        try:
            tensors = random_inputs(args.inputs, random_batches, seed=args.seed)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        tensors, bound = bind_to_forward(names, tensors, forward, "--input")
        return tensors, bound, f"random data from --input ({random_batches} batches)"
    if hf is not None:
        return _pretrained_samples(args, hf, random_text_samples)
    if args.input_shape is None:
        raise CliError("give --calib-data FILE (.npz or .pt), --input NAME:DTYPE:SHAPE[:LOW-HIGH] or --input-shape "
                       "(e.g. 1,3,224,224)")
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.input_shape[0] * random_batches, *args.input_shape[1:])
    tensors, bound = bind_to_forward(None, (torch.randn(shape, generator=generator),), forward,
                                                      "--input-shape")
    return tensors, bound, f"random normal data of shape {args.input_shape} ({random_batches} batches)"


def _pretrained_samples(args: argparse.Namespace, hf: Any, random_text_samples: int
                        ) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...], str]:
    from coreai_opt.huggingface import IMAGE_SUFFIXES

    try:
        if args.calib_text is not None:
            lines = [line for line in args.calib_text.read_text(encoding="utf-8").splitlines() if line.strip()]
            return hf.text_inputs(lines), hf.input_names, f"{args.calib_text} ({len(lines)} lines, {hf.seq_len} tokens)"
        if args.calib_images is not None:
            files = sorted(p for p in args.calib_images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise CliError(f"{args.calib_images} holds no images ({', '.join(IMAGE_SUFFIXES)})")
            return hf.image_inputs(files), hf.input_names, f"{args.calib_images} ({len(files)} images)"
    except (ValueError, OSError) as exc:
        raise CliError(one_line(exc)) from None
    what = f"{hf.seq_len} random token ids in [0, {hf.vocab_size})" if hf.modality == "text" else "random pixels"
    return hf.random_inputs(random_text_samples, seed=args.seed), hf.input_names, \
        f"random data ({random_text_samples} samples of {what})"
