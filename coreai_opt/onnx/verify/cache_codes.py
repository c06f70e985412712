"""A KV cache the file stores as int8 codes, fed and read by ``verify_onnx`` in the eager model's float values.

With ``QuantizerConfig.kv_cache`` the eager decoder takes and returns its cache as float tensors on the cache
quantizers' grid (``x = q · S``), the file as the codes ``q`` (int8 ``past_key_values.{i}.*`` inputs and
``present.{i}.*`` outputs: :mod:`coreai_opt.onnx.rewrite.kv_cache_codes`). The scale of cache tensor ``j`` (in
:class:`~coreai_opt.graph.kv_cache_decoder.DecoderWithCache` order: layer ``j // 2``, key then value) is the
frozen scale of the eager model's quantizer ``kv_cache_quantizers.{layer}_{key|value}``, so a float cache
converts to the file's codes exactly (``round(x / S)`` of a value on the grid) and the file's codes back to the
eager values exactly (``q · S``, the same float32 products). ``verify_onnx`` first puts every cache input of its
batches on that grid (:meth:`CacheScales.snap`), so eager and the runtime read the same cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from torch import nn

from coreai_opt.passes.quantize_kv_cache import cache_quantizer_target

__all__ = ["CacheScales", "cache_scales"]

_CACHE_INPUTS_FROM = 3  # input_ids, attention_mask, position_ids, then the cache
_CACHE_OUTPUTS_FROM = 1  # logits, then the cache


class CacheScales:
    """The scales of the int8 cache inputs / outputs of one file, by graph input / output position."""

    def __init__(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> None:
        self.inputs, self.outputs = inputs, outputs

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    def snap(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``batch`` with each float cache input as the file can hold it: ``S · clamp(round(x / S))``.

        A cache computed by another model (the float one, or a batch made up for the check) is not on the grid;
        eager and the runtime then both read the values the int8 cache holds.
        """
        snapped = list(batch)
        for index, scale in self.inputs.items():
            if index < len(snapped) and snapped[index].is_floating_point():
                s = torch.from_numpy(scale)
                snapped[index] = torch.clamp(torch.round(snapped[index] / s), -128, 127) * s
        return tuple(snapped)

    def feed(self, names: Sequence[str], batch: Sequence[torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
        """The runtime feed of ``batch``: the float cache inputs as their int8 codes ``clamp(round(x / S))``."""
        feed = {}
        for index, (name, value) in enumerate(zip(names, batch, strict=True)):
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            scale = self.inputs.get(index)
            if scale is not None and array.dtype != np.int8:
                array = np.clip(np.rint(array / scale), -128, 127).astype(np.int8)
            feed[name] = array
        return feed

    def values(self, outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The runtime's outputs with the int8 cache outputs as their float values ``q · S``."""
        return [out.astype(np.float32) * self.outputs[k] if k in self.outputs and out.dtype == np.int8 else out
                for k, out in enumerate(outputs)]


def _scale_of(model: nn.Module, cache_index: int) -> np.ndarray | None:
    """The frozen scale of cache tensor ``cache_index``'s quantizer (``kv_cache_quantizers.{layer}_{key|value}``)."""
    try:
        fq = model.get_submodule(cache_quantizer_target(cache_index))
    except AttributeError:
        return None
    return fq.get_qparams().scale.detach().cpu().numpy().astype(np.float32)


def cache_scales(model: nn.Module, graph: onnx.GraphProto) -> CacheScales:
    """The scales of ``graph``'s int8 cache inputs and outputs, read from ``model``'s cache quantizers.

    Raises:
        ValueError: The file stores a cache as int8 but ``model`` has no cache quantizer for it (not the model
            that was exported).
    """
    found: list[dict[int, np.ndarray]] = [{}, {}]
    for side, (values, first) in enumerate(((graph.input, _CACHE_INPUTS_FROM), (graph.output, _CACHE_OUTPUTS_FROM))):
        for index, value in enumerate(values):
            if index < first or value.type.tensor_type.elem_type != onnx.TensorProto.INT8:
                continue
            scale = _scale_of(model, index - first)
            if scale is None:
                raise ValueError(f"the file stores {value.name!r} as int8 KV-cache codes, but the model has no "
                                 f"kv_cache quantizer for it; verify with the converted model that was exported")
            found[side][index] = scale
    return CacheScales(*found)
