"""``export_onnx(..., task="text-generation")``: the graph input / output names and symbolic axes of a KV-cache decoder.

A decoder wrapped by :class:`coreai_opt.graph.kv_cache_decoder.DecoderWithCache` takes ``3 + 2 L`` tensors and
returns ``1 + 2 L``; this module names them as onnxruntime-genai's model builder does, so the file is a drop-in
decoder (``L`` = layers, ``H_kv`` = key / value heads, ``D`` = head width):

====================================  ==============================================================
``input_ids``, ``position_ids``       ``(batch_size, sequence_length)`` int64
``attention_mask``                    ``(batch_size, total_sequence_length)`` int64,
                                      ``total = past + sequence``
``past_key_values.{i}.key / .value``  ``(batch_size, H_kv, past_sequence_length, D)`` (0 at prefill)
``logits``                            ``(batch_size, sequence_length, vocab)``
``present.{i}.key / .value``          ``(batch_size, H_kv, total_sequence_length, D)``
====================================  ==============================================================
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from coreai_opt.graph.kv_cache_decoder import kv_cache_names
from coreai_opt.onnx.export.dynamic_axes import DynamicShapes
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.spec import PerTensor

__all__ = ["TEXT_GENERATION", "TASKS", "DecoderIo", "task_io", "warn_per_tensor_dynamic"]

TEXT_GENERATION = "text-generation"
#: The values ``export_onnx``'s ``task`` accepts.
TASKS = (TEXT_GENERATION,)
_TOKENS = {0: "batch_size", 1: "sequence_length"}
_CACHE = {0: "batch_size", 2: "past_sequence_length"}

DecoderIo = tuple[list[str], list[str], dict[str, dict[int, str] | None]]


def task_io(task: str, num_inputs: int, input_names: Sequence[str] | None, output_names: Sequence[str] | None,
            dynamic_shapes: DynamicShapes | None) -> DecoderIo:
    """Input names, output names and symbolic axes for ``task`` (names and axes the caller gave win).

    Raises:
        ValueError: An unknown task, or a model whose input count is not ``3 + 2 * layers``.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; export_onnx knows {list(TASKS)} (or task=None for a plain "
                         "forward)")
    layers, odd = divmod(num_inputs - 3, 2)
    if num_inputs < 5 or odd:
        raise ValueError(f"task={task!r} exports a KV-cache decoder taking input_ids, attention_mask, position_ids "
                         f"and a key and a value per layer (3 + 2 * layers inputs), but the example has {num_inputs} "
                         "inputs; wrap the model in coreai_opt.graph.kv_cache_decoder.DecoderWithCache before "
                         "prepare (co.from_pretrained(..., task='text-generation') does it)")
    past = kv_cache_names(layers, "past_key_values")
    ins = list(input_names) if input_names is not None else ["input_ids", "attention_mask", "position_ids", *past]
    outs = list(output_names) if output_names is not None else ["logits", *kv_cache_names(layers, "present")]
    axes: dict[str, dict[int, str] | None] = {
        ins[0]: dict(_TOKENS), ins[1]: {0: "batch_size", 1: "total_sequence_length"}, ins[2]: dict(_TOKENS),
        **{name: dict(_CACHE) for name in ins[3:]}}
    axes.update({name: None if value is None else dict(value) for name, value in (dynamic_shapes or {}).items()})
    return ins, outs, axes


def warn_per_tensor_dynamic(quantizers: Sequence[nn.Module]) -> None:
    """Warn when a KV-cache decoder quantizes activations dynamically with one scale per call.

    ``s = (max x - min x) / 255`` over a whole call rounds a one-token decode step and a full regeneration of the same
    position on different grids, so decoding with the cache and regenerating drift apart (3-9 near-tie flips in 256
    tokens on the llm benchmark's families); one scale per token (``PerToken()``) does not.
    """
    per_call = [q.name for q in quantizers if isinstance(q, FakeQuantize) and q.exports_dynamic
                and isinstance(q.spec.granularity, PerTensor)]
    if per_call:
        warnings.warn(
            f"task='text-generation' with {len(per_call)} dynamic activation quantizer(s) of one scale per call "
            f"({', '.join(per_call[:3])}{' ...' if len(per_call) > 3 else ''}): a KV-cache decode step and a full "
            "regeneration round the same token differently; prepare with "
            "QuantizerConfig.presets.w8a8_dynamic(per_token=True) (one scale per token, as --task text-generation "
            "does)", UserWarning, stacklevel=3)
