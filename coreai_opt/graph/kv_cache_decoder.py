"""A Hugging Face causal LM as one graph that serves prefill and decode: the KV cache as flat tensors.

``DecoderWithCache(model)`` takes ``(input_ids, attention_mask, position_ids, past_key_values.0.key,
past_key_values.0.value, ..., past_key_values.{L-1}.value)`` and returns ``(logits, present.0.key, present.0.value,
...)``, the names and layout of onnxruntime-genai's builder: keys and values of shape
``(batch, kv_heads, past_sequence, head_dim)``; ``attention_mask`` of shape ``(batch, past_sequence + sequence)``;
``present.{i}`` is ``past_key_values.{i}`` with this step's ``sequence`` positions appended. Prefill passes a past
of length 0; each decode step passes the previous step's presents. The wrapper builds the model's own
``DynamicCache`` from the flat tensors, so the attention code that runs (and is captured) is the model's.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.graph.attention_math import masked_softmax

__all__ = ["DecoderWithCache", "kv_cache_names", "causal_mask", "ATTENTION"]

#: The attention function the wrapper registers with transformers and switches the model to (same math as "sdpa").
ATTENTION = "coreai_opt_kv_cache"


def kv_cache_names(num_layers: int, prefix: str) -> tuple[str, ...]:
    """``prefix.0.key, prefix.0.value, ..., prefix.{L-1}.value`` (``prefix``: ``past_key_values`` or ``present``)."""
    return tuple(f"{prefix}.{i}.{part}" for i in range(num_layers) for part in ("key", "value"))


class DecoderWithCache(nn.Module):
    """``model`` (a transformers ``*ForCausalLM``) with its KV cache as flat inputs and outputs (module docstring).

    Attributes:
        model: The causal LM (its ``config.use_cache`` is left as it is; the wrapper asks for the cache per call).
        num_layers: Decoder layers (``config.num_hidden_layers``): ``2 * num_layers`` cache tensors in and out.
        kv_heads: Key / value heads (``config.num_key_value_heads``, else ``num_attention_heads``).
        head_dim: Width of one head (``config.head_dim``, else ``hidden_size // num_attention_heads``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        self.model = model
        self.num_layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        _register_attention()

    def empty_cache(self, batch_size: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """The ``2 * num_layers`` past tensors of a prefill: shape ``(batch_size, kv_heads, 0, head_dim)``."""
        return tuple(torch.zeros(batch_size, self.kv_heads, 0, self.head_dim, dtype=dtype)
                     for _ in range(2 * self.num_layers))

    def __new__(cls, model: nn.Module | None = None) -> DecoderWithCache:
        """An instance of the subclass for ``model``'s layer count, whose ``forward()`` names every input.

        prepare / calibrate / export then see ``3 + 2 * num_layers`` named tensors (``past_0_key``,
        ``past_0_value``, ...; :func:`argument_names`) instead of one ``*args``.
        """
        if model is None or cls in _NAMED_CLASSES.values():  # copy.deepcopy / pickle, or already named
            return super().__new__(cls)
        layers = int(model.config.num_hidden_layers)
        named = _NAMED_CLASSES.get(layers)
        if named is None:
            named = _NAMED_CLASSES[layers] = _named_subclass(cls, layers)
        return super().__new__(named)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past_key_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits ``(batch, sequence, vocab)`` and the ``2 * num_layers`` present keys / values."""
        if len(past_key_values) != 2 * self.num_layers:
            raise ValueError(f"expected {2 * self.num_layers} past key / value tensors ({self.num_layers} layers), "
                             f"got {len(past_key_values)}")
        cache = _dynamic_cache(self.num_layers, past_key_values)
        mask = causal_mask(attention_mask, input_ids.shape[1])
        with _attention_implementation(self.model.config, ATTENTION):
            out: Any = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                                  use_cache=True)
        flat: list[torch.Tensor] = []
        for layer in cache.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


    def example_inputs(self, batch_size: int = 2, sequence: int = 3, past: int = 2) -> tuple[torch.Tensor, ...]:
        """Inputs for capture: ``sequence`` token ids after ``past`` cached positions (random keys / values).

        Every size is at least 2, so ``torch.export`` keeps batch, sequence and past length symbolic (it fixes
        sizes 0 and 1), and the one captured graph serves prefill (past 0) and decode (sequence 1).
        """
        if min(batch_size, sequence, past) < 2:
            raise ValueError(f"capture needs batch_size, sequence and past of at least 2 (sizes 0 and 1 are fixed "
                             f"by torch.export), got {batch_size}, {sequence}, {past}")
        generator = torch.Generator().manual_seed(0)
        vocab = int(self.model.config.vocab_size)
        ids = torch.randint(0, vocab, (batch_size, sequence), generator=generator)
        mask = torch.ones(batch_size, past + sequence, dtype=torch.int64)
        positions = torch.arange(past, past + sequence).repeat(batch_size, 1)
        cache = tuple(torch.randn(batch_size, self.kv_heads, past, self.head_dim, generator=generator)
                      for _ in range(2 * self.num_layers))
        return (ids, mask, positions, *cache)

    def capture_dynamic_shapes(self) -> dict[str, dict[int, Any]]:
        """``prepare(..., dynamic_shapes=...)``: batch and sequence of the tokens, batch and length of the cache."""
        auto = torch.export.Dim.AUTO
        return {name: {0: auto, 1: auto} if i < 3 else {0: auto, 2: auto}
                for i, name in enumerate(argument_names(self.num_layers))}

    @torch.no_grad()
    def calibration_batches(self, prompts: list[torch.Tensor], decode_steps: int = 4) -> list[tuple[torch.Tensor, ...]]:
        """Prefill and decode inputs for calibration, one prompt at a time at its real length (no padding).

        For each prompt (1-D token ids) this yields the prefill batch (past of length 0) and ``decode_steps``
        one-token batches, each continuing the greedy choice of the float model with the float model's cache, so
        the quantizers see the ranges of both phases.
        """
        batches: list[tuple[torch.Tensor, ...]] = []
        for prompt in prompts:
            ids = prompt.reshape(1, -1).to(torch.int64)
            past = self.empty_cache(1)
            for _ in range(decode_steps + 1):
                start = past[0].shape[2]
                mask = torch.ones(1, start + ids.shape[1], dtype=torch.int64)
                positions = torch.arange(start, start + ids.shape[1]).reshape(1, -1)
                batch = (ids, mask, positions, *past)
                batches.append(batch)
                logits, *present = self(*batch)
                ids, past = logits[:, -1:].argmax(-1), tuple(present)
        return batches


_NAMED_CLASSES: dict[int, type[DecoderWithCache]] = {}


def argument_names(num_layers: int) -> tuple[str, ...]:
    """forward()'s parameter names: ``input_ids, attention_mask, position_ids, past_0_key, past_0_value, ...``."""
    return ("input_ids", "attention_mask", "position_ids",
            *(f"past_{i}_{part}" for i in range(num_layers) for part in ("key", "value")))


def _named_subclass(base: type[DecoderWithCache], num_layers: int) -> type[DecoderWithCache]:
    def forward(self: DecoderWithCache, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return base.forward(self, *inputs)

    tensor = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", tensor)]
        + [inspect.Parameter(name, tensor, annotation=torch.Tensor) for name in argument_names(num_layers)])
    forward.__doc__ = base.forward.__doc__
    return type(f"{base.__name__}{num_layers}Layers", (base,), {"forward": forward, "__module__": base.__module__})


def causal_mask(attention_mask: torch.Tensor, sequence: int) -> torch.Tensor:
    r"""The 4-D boolean mask (``True`` = attend) of ``sequence`` new tokens over ``total`` cached + new positions.

    With :math:`T` = ``attention_mask.shape[1]`` and :math:`P = T - S` the past length, query :math:`i` of batch
    row :math:`b` sees key :math:`j` iff :math:`j \le P + i` and ``attention_mask[b, j] == 1``; shape
    ``(batch, 1, S, T)``. Built here from the 2-D mask alone (the model gets it ready-made), so the captured graph
    holds no branch on how the mask's length compares with the cache's: the two are equal by contract.
    """
    total = attention_mask.shape[1]
    query = torch.arange(sequence, device=attention_mask.device) + (total - sequence)
    key = torch.arange(total, device=attention_mask.device)
    causal = key[None, :] <= query[:, None]
    return causal[None, None, :, :] & attention_mask.bool()[:, None, None, :]


#: Keyword arguments of transformers' attention-function contract that change the math and that :func:`_attention`
#: does not implement: a model passing one of them (not None) is refused rather than computed without it.
UNSUPPORTED_ATTENTION_ARGUMENTS = ("s_aux", "sinks", "attention_chunk_size", "head_mask")


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, softcap: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    r"""Transformers' attention-function contract: ``softmax(q k^T * scaling + mask) v``, heads then tokens swapped.

    Unlike transformers' "sdpa" it has no branch on the query length (decode's one token vs prefill), so one
    captured graph serves both. Grouped-query heads (``G = heads / kv_heads`` query heads per key / value head,
    head ``h = j G + g`` reading key head ``j``) are folded into the query axis instead of repeating the keys and
    values: ``q`` ``(B, H, S, D)`` is read as ``(B, H_kv, G S, D)`` and the mask's query axis repeated ``G`` times.
    Every score is the same dot product, but no step copies the whole cache ``G`` times (SDPA's ``enable_gqa``
    exports as ``Expand`` + ``Reshape`` of the keys and values, work that grows with the past length). Two per-layer
    options of the contract are applied here, since the wrapper hands the model one ready-made mask for every layer:

    * ``sliding_window`` :math:`W` (Mistral, Qwen2, Phi-3, Gemma2's local layers): with :math:`S` queries over
      :math:`T` keys, query :math:`i` sits at position :math:`T - S + i` and sees key :math:`j` only when
      :math:`j > T - S + i - W` (transformers' ``sliding_window_overlay``), on top of ``attention_mask``.
    * ``softcap`` :math:`c` (Gemma2): the logits :math:`s = q k^\top \cdot` ``scaling`` become
      :math:`c \tanh(s / c)` before the mask and softmax (keys and values repeated per query head there).

    Raises:
        CoreaiOptValueError: The model passes an option of :data:`UNSUPPORTED_ATTENTION_ARGUMENTS`.
    """
    given = [name for name in UNSUPPORTED_ATTENTION_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        raise CoreaiOptValueError(
            f"{type(module).__name__} passes {', '.join(given)} to its attention function, which the KV-cache "
            "decoder export does not implement; export this model without task='text-generation'")
    if sliding_window is not None and attention_mask is not None:
        attention_mask = attention_mask & _window(query.shape[2], key.shape[2], int(sliding_window), query.device)
    batch, heads, sequence, width = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if softcap is not None:
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scale = width ** -0.5 if scaling is None else scaling
        logits = torch.matmul(query, key.transpose(-2, -1)) * scale
        capped = torch.tanh(logits / softcap) * softcap
        return torch.matmul(masked_softmax(capped, 1.0, attention_mask), value).transpose(1, 2).contiguous(), None
    if groups > 1:
        query = query.reshape(batch, kv_heads, groups * sequence, width)
        if attention_mask is not None and attention_mask.shape[1] == 1:
            total = attention_mask.shape[-1]
            attention_mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
                attention_mask.shape[0], 1, groups * sequence, total)
        elif attention_mask is not None:
            attention_mask = attention_mask.reshape(attention_mask.shape[0], kv_heads, groups * sequence, -1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, sequence, width).transpose(1, 2).contiguous(), None


def _window(sequence: int, total: int, window: int, device: torch.device) -> torch.Tensor:
    """``(sequence, total)`` bool: key ``j`` lies within ``window`` positions of query ``i`` (at ``total - S + i``)."""
    query = torch.arange(sequence, device=device) + (total - sequence)
    key = torch.arange(total, device=device)
    return key[None, :] > query[:, None] - window


@contextlib.contextmanager
def _attention_implementation(config: Any, name: str) -> Iterator[None]:
    """Run the model with attention ``name`` for one call; the user's config reads as before afterwards."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def full_mask(*args: Any, **kwargs: Any) -> Any:
        # never "skip the mask, SDPA's is_causal will do": _attention has no is_causal, so a call of the model
        # outside the wrapper (mask built by transformers) stays causal
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, full_mask)


def _dynamic_cache(num_layers: int, flat: tuple[torch.Tensor, ...]) -> Any:
    """A ``DynamicCache`` of full-length layers holding ``flat``'s keys and values.

    Full-length for every layer, sliding-window ones included: transformers' sliding layer keeps only the last
    ``W - 1`` positions, so ``present`` would stop matching ``attention_mask``'s length; the window is applied by
    the mask instead (:func:`_attention`).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(num_layers)]
    for i, layer in enumerate(cache.layers):
        key, value = flat[2 * i], flat[2 * i + 1]
        layer.lazy_initialization(key, value)
        # the past itself, not cat(empty constant, past) as update() would: a constant would get its own quantizer
        layer.keys, layer.values = key, value
    return cache
