"""Rule 5 of :mod:`coreai_opt.onnx.verify.quantizer_codes` (``missing``): activation calls with no node in the file.

Every activation quantizer eager calls must have a counterpart in the file: a node whose ``namespace`` metadata
names the traced call (:func:`traced_calls`), an untraced ``QuantizeLinear`` / ``DequantizeLinear`` reading its
scale buffer by name (:func:`untraced_scales`: a pair ``linears_to_gemm`` rebuilt), a traced call with the same
scale buffer (a shared quantizer), or a traced call with the same :func:`input_key`: equal input bytes, scale and
zero point, a duplicate the exporter's optimizer merged (hf-funnel: two blocks' ``(1 - mask) · 1e6`` quantizers
become one pair read by both blocks). Equal inputs, not equal outputs: a requantization of codes already on their
grid has the output of the call before it (hf-llama's residual sum and its norm's cast), and dropping the first
pair is a defect that must stay flagged.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import onnx
import torch

from coreai_opt.onnx.rewrite.rewrite_report import ABSORBED_KEY

__all__ = ["input_key", "missing_calls", "traced_calls", "untraced_scales"]

_TRACED_CALL = re.compile(r"quantize_dequantize(?:_(\d+))?: coreai_opt\.quantize_dequantize\.default")


def traced_calls(model: onnx.ModelProto) -> set[int]:
    """Indices of the ``coreai_opt::quantize_dequantize`` calls some node's ``namespace`` metadata names.

    Also those a rewrite rule folded into a node exactly (its :data:`ABSORBED_KEY` entry: the pad's pair that
    ``fold_pads_into_convs`` moved into a ``QLinearConv``'s zero-point padding).
    """
    calls = set()
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key in ("namespace", ABSORBED_KEY):
                calls.update(int(m.group(1) or 0) for m in _TRACED_CALL.finditer(prop.value))
    return calls


def untraced_scales(model: onnx.ModelProto) -> set[str]:
    """Scale names (``.`` as ``_``) read by ``QuantizeLinear`` / ``DequantizeLinear`` nodes no call is traced to.

    A rewrite rule that rebuilds a pair (``linears_to_gemm``: ``Reshape -> DQ -> Gemm -> Q -> Reshape``) writes new
    nodes without ``namespace`` metadata; they still read the quantizer's lifted scale buffer by its name.
    """
    return {node.input[1].replace(".", "_") for node in model.graph.node
            if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 1
            and not any(p.key == "namespace" and _TRACED_CALL.search(p.value) for p in node.metadata_props)}


def input_key(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[object, ...]:
    """Shape, dtype and a 128-bit BLAKE2 digest of the bytes of a quantizer call's input, with its qparams' bytes."""
    def raw(t: torch.Tensor) -> np.ndarray:
        return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()

    return (tuple(x.shape), str(x.dtype), hashlib.blake2b(raw(x), digest_size=16).digest(), tuple(scale.shape),
            raw(scale).tobytes(), raw(zero_point).tobytes())


def missing_calls(activations: dict[int, tuple[tuple[int, ...], int]], keys: dict[int, tuple[object, ...]],
                  traced: set[int], rebuilt: set[str], buffers: dict[int, str]) -> list[tuple[int, tuple[int, ...]]]:
    """``(call, input shape)`` of each activation call with no counterpart in the file (module docstring).

    Args:
        activations: Activation call -> (input shape, storage address of its scale), in call order.
        keys: Activation call -> :func:`input_key`.
        traced: :func:`traced_calls` of the file.
        rebuilt: :func:`untraced_scales` of the file.
        buffers: Storage address -> the model's buffer name (``.`` as ``_``).
    """
    shared = {scale for call, (_, scale) in activations.items() if call in traced}
    kept = {keys[call] for call in activations if call in traced and call in keys}
    return [(call, shape) for call, (shape, scale) in activations.items()
            if call not in traced and buffers.get(scale) not in rebuilt and scale not in shared
            and keys.get(call) not in kept]
