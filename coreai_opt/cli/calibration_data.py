"""Calibration inputs of ``coreai-opt quantize``: read from a file, bound to ``forward()`` by name.

* ``.npz``: arrays saved by name (``np.savez(f, input_ids=..., attention_mask=...)``) bind to the forward()
  arguments of those names, in forward() order, whatever order the file stores them in. Arrays saved without
  names (``np.savez(f, a, b)``: keys ``arr_0``, ``arr_1``) bind by position.
* ``.pt``: a dict of tensors binds by name like an ``.npz``; a tensor or a tuple/list of tensors by position.

Every tensor has the sample dimension first. Inputs are passed to the model by position, so the named inputs
must be the first forward() arguments: one left out before a given one is an error, as is an unknown name or a
missing required argument.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from coreai_opt.cli.errors import CliError, one_line

if TYPE_CHECKING:
    import torch

__all__ = ["read_named_tensors", "bind_to_forward", "check_sample_counts"]

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
