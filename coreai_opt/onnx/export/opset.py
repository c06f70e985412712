"""Choose the ONNX opset from the quantized dtypes and granularities a model uses.

==================================================  ===========  ===============================================
quantizers in the model                             lowest opset why
==================================================  ===========  ===============================================
none / int8 / uint8 / int32 bias, per-tensor/axis   18           lowest opset the dynamo exporter emits natively
                                                                 (17 and below go through a lossy down-converter)
float8_e4m3fn / float8_e5m2                         19           first QuantizeLinear with float8 types
int16 / uint16 / int4 / uint4                       21           onnxruntime rejects them below 21 (invalid model)
any per-block or per-token quantizer               21           ``block_size`` attribute appears in opset 21
a GELU (``nn.GELU`` / ``F.gelu``), default pick     20           ONNX ``Gelu`` appears in opset 20; below it the
                                                                 exporter writes Div/Erf/Add/Mul/Mul, which
                                                                 onnxruntime cannot fuse back once each reader of
                                                                 the input gets its own DequantizeLinear
==================================================  ===========  ===============================================

Op rows only raise the default pick: an explicitly requested lower opset still exports (the op decomposed).

The highest opset accepted is :data:`MAX_OPSET` (the newest one verified with onnxruntime 1.32). A dtype without an
onnxruntime QuantizeLinear/DequantizeLinear kernel (e.g. ``float4_e2m1``: ``NOT_IMPLEMENTED`` in onnxruntime 1.32)
is refused, since the exported file could not be run or verified.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx, nn

from coreai_opt.quantization.ops.quantize_dequantize_op import BLOCKED_MIN_OPSET
from coreai_opt.quantization.spec.dtypes import SUPPORTED_DTYPES, get_dtype_info

__all__ = [
    "QuantizerUse", "MIN_OPSET", "MAX_OPSET", "BLOCKED_MIN_OPSET", "GELU_OPSET", "select_opset", "required_opset",
    "preferred_opset",
]

#: Lowest opset the dynamo exporter (torch 2.13) writes without version conversion.
MIN_OPSET = 18
#: Highest opset verified end to end (export, onnxruntime 1.32 load and run).
MAX_OPSET = 23
#: ONNX ``Gelu`` (one op, ``approximate="none"`` or ``"tanh"``) exists from opset 20.
GELU_OPSET = 20

_GELU_FUNCTIONS = (torch.nn.functional.gelu, torch.ops.aten.gelu.default)


@dataclass(frozen=True)
class QuantizerUse:
    """What one quantizer asks of the opset.

    Attributes:
        dtype: Quantized dtype name (``"int8"``, ``"float8_e4m3fn"``, internal ``"int32"`` for biases).
        blocked: True for a per-block or per-token granularity (both export a ``block_size``).
        name: The quantizer's name, used in error messages.
        granularity: The blocked granularity's name for messages (``"per-block"`` or ``"per-token"``).
    """

    dtype: str
    blocked: bool
    name: str = ""
    granularity: str = "per-block"


def _dtype_min_opset(use: QuantizerUse) -> int:
    try:
        info = get_dtype_info(use.dtype, allow_internal=True)
    except ValueError:
        raise ValueError(
            f"quantizer {use.name or '<unnamed>'!r} uses dtype {use.dtype!r}, which has no onnxruntime "
            f"QuantizeLinear/DequantizeLinear kernel, so the exported model could not run; use one of "
            f"{', '.join(SUPPORTED_DTYPES)}"
        ) from None
    return info.min_opset


def required_opset(use: QuantizerUse) -> int:
    """Return the lowest opset that can export ``use`` (at least :data:`MIN_OPSET`)."""
    needed = max(MIN_OPSET, _dtype_min_opset(use))
    return max(needed, BLOCKED_MIN_OPSET) if use.blocked else needed


def _describe(use: QuantizerUse) -> str:
    what = f"dtype {use.dtype!r}" + (f" with {use.granularity} granularity" if use.blocked else "")
    return f"quantizer {use.name!r} ({what})" if use.name else what


def preferred_opset(model: nn.Module) -> int:
    """Return the lowest opset in which every op of ``model`` exports as a single ONNX op (see the table above).

    Looks for ``nn.GELU`` modules and, in a GraphModule, ``F.gelu`` / ``aten.gelu`` calls.
    """
    has_gelu = any(isinstance(m, nn.GELU) for m in model.modules())
    if not has_gelu and isinstance(model, fx.GraphModule):
        has_gelu = any(n.op == "call_function" and n.target in _GELU_FUNCTIONS for n in model.graph.nodes)
    return GELU_OPSET if has_gelu else MIN_OPSET


def select_opset(uses: Iterable[QuantizerUse], requested: int | None = None, *, preferred: int = MIN_OPSET) -> int:
    """Return the opset to export with.

    Args:
        uses: One entry per quantizer in the model.
        requested: An explicit opset, or None for the lowest one every quantizer allows, raised to ``preferred``.
        preferred: The opset the model's ops export best with (:func:`preferred_opset`); it only affects the
            default pick, never rejects an explicit ``requested``.

    Returns:
        ``requested`` when it is high enough, else the lowest sufficient opset.

    Raises:
        TypeError: ``requested`` is not an int.
        ValueError: ``requested`` is outside ``[MIN_OPSET, MAX_OPSET]`` or too low for one of the dtypes (the
            message names the dtype and its minimum opset), or a dtype has no onnxruntime kernel.
    """
    uses = list(uses)
    needed = {use: required_opset(use) for use in uses}
    lowest = max(needed.values(), default=MIN_OPSET)
    if requested is None:
        return min(max(lowest, preferred), MAX_OPSET)
    if not isinstance(requested, int) or isinstance(requested, bool):
        raise TypeError(f"opset must be an int or None, got {requested!r}")
    if not MIN_OPSET <= requested <= MAX_OPSET:
        raise ValueError(
            f"opset={requested} is not supported; the exporter writes opsets {MIN_OPSET}..{MAX_OPSET} "
            f"(pass opset=None to pick the lowest one the model allows, here {lowest})"
        )
    too_low = [use for use in uses if needed[use] > requested]
    if too_low:
        worst = max(too_low, key=lambda use: needed[use])
        raise ValueError(
            f"opset={requested} is too low for {_describe(worst)}: it needs opset >= {needed[worst]}; "
            f"pass opset={lowest} or opset=None"
        )
    return requested
