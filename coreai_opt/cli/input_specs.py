"""``--input NAME:DTYPE:SHAPE[:LOW-HIGH]``: describe one model input so random calibration data can be made.

Examples::

    --input input_ids:int64:1,128:0-30521      token ids, uniform in [0, 30521] (both ends included)
    --input attention_mask:int64:1,128:1-1     all ones
    --input pixel_values:float32:1,3,224,224   standard normal
    --input x:float32:8,16:-1-1                uniform in [-1, 1)

The first dimension of SHAPE is the batch size. Integer and bool inputs need a range (``bool`` takes ``0-1``);
float inputs are standard normal without one.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "InputSpec", "parse_input_spec", "random_inputs"]

#: Accepted DTYPE names (torch dtype names).
DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_FLOAT = ("float32", "float16", "float64")
_NUMBER = r"-?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"
_RANGE = re.compile(rf"^({_NUMBER})-({_NUMBER})$")
_EXAMPLE = "e.g. input_ids:int64:1,128:0-30521 or pixel_values:float32:1,3,224,224"


@dataclass(frozen=True)
class InputSpec:
    """One ``--input``: name, dtype, shape of one batch and an optional value range (inclusive for integers)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    low: float | None = None
    high: float | None = None


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``NAME:DTYPE:SHAPE[:LOW-HIGH]`` (argparse ``type=``).

    Raises:
        argparse.ArgumentTypeError: A malformed spec; the message shows the expected form.

    Example:
        >>> parse_input_spec("input_ids:int64:1,16:0-999")
        InputSpec(name='input_ids', dtype='int64', shape=(1, 16), low=0.0, high=999.0)
    """
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"expected NAME:DTYPE:SHAPE[:LOW-HIGH], {_EXAMPLE}; got {text!r}")
    name, dtype, shape_text = parts[:3]
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"input name {name!r} in {text!r} is not a forward() argument name")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {dtype!r} in {text!r}; use one of {', '.join(DTYPES)}")
    try:
        shape = tuple(int(p) for p in shape_text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {shape_text!r} in {text!r} must be comma-separated integers, "
                                         f"{_EXAMPLE}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape {shape_text!r} in {text!r} must be positive integers")
    low = high = None
    if len(parts) == 4:
        match = _RANGE.match(parts[3])
        if not match:
            raise argparse.ArgumentTypeError(f"range {parts[3]!r} in {text!r} must be LOW-HIGH, e.g. 0-30521")
        low, high = float(match.group(1)), float(match.group(2))
        if low > high:
            raise argparse.ArgumentTypeError(f"range {parts[3]!r} in {text!r} has LOW > HIGH")
        if dtype not in _FLOAT and (low != int(low) or high != int(high)):
            raise argparse.ArgumentTypeError(f"range {parts[3]!r} of the {dtype} input {name!r} must be integers")
    elif dtype not in _FLOAT:
        raise argparse.ArgumentTypeError(f"the {dtype} input {name!r} needs a value range, e.g. {text}:0-30521 for "
                                         "token ids of a 30522-word vocabulary")
    return InputSpec(name, dtype, shape, low, high)


def random_inputs(specs: list[InputSpec], batches: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``batches`` batches of random values per spec, concatenated along the sample dimension.

    Integers are uniform over ``[low, high]``, floats uniform over ``[low, high)`` with a range and standard
    normal without one.

    Raises:
        ValueError: The specs disagree on the batch size.
    """
    import torch

    sizes = {spec.shape[0] for spec in specs}
    if len(sizes) > 1:
        listing = ", ".join(f"{s.name}: {s.shape[0]}" for s in specs)
        raise ValueError(f"every --input needs the same batch size (first dimension), got {listing}")
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for spec in specs:
        shape = (spec.shape[0] * batches, *spec.shape[1:])
        dtype = getattr(torch, spec.dtype)
        if spec.dtype in _FLOAT:
            if spec.low is None:
                values = torch.randn(shape, generator=generator)
            else:
                values = spec.low + (spec.high - spec.low) * torch.rand(shape, generator=generator)
        else:
            values = torch.randint(int(spec.low), int(spec.high) + 1, shape, generator=generator)
        tensors.append(values.to(dtype))
    return tuple(tensors)
