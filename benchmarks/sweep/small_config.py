"""Small transformers configs for the sweep, built by rules keyed by config fields (no architecture is named).

:func:`shrink_config` rebuilds a library default config small through its constructor: the size fields it has are
set small (:data:`SMALL_SIZES`, :data:`SUFFIX_SIZES`: head parts, low ranks, experts), stage lists get one block per
stage and widths divided by one factor (the first becomes 16; a ``*channels`` field equal to a stage width follows
it), another name for the model width follows ``hidden_size``, per-layer lists follow the layer count, block
repeat counts named apart from it are capped by it (and a count of some of the layers scales with it; a heterogeneous
``per_layer_config`` shrinks layer by layer), sub-configs
shrink the same way, every vocabulary is :data:`VOCAB`, and the special tokens the heads read exist (a pad token,
an end-of-sequence token). :func:`config_for` hands a model class the sub-config of the type it takes (a causal LM
built on a composite config's decoder).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

__all__ = ["EOS_ID", "IMAGE", "NUM_LABELS", "PAD_ID", "SMALL_SIZES", "SUFFIX_SIZES", "VOCAB", "config_for",
           "shrink_config"]

NUM_LABELS = 4
VOCAB = 512  # every vocabulary (special token ids beyond it move below it)
IMAGE = 64

#: Scalar config fields set when the config has them (hidden 32, 2 layers, 2 heads of 16).
SMALL_SIZES: dict[str, int] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 64, "head_dim": 16, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_inner": 64,
    "d_model": 32, "d_ff": 64, "d_kv": 16, "num_layers": 2, "num_heads": 2, "encoder_layers": 2,
    "decoder_layers": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "embed_dim": 32, "embedding_size": 32, "projection_dim": 32, "ffn_dim": 64,
    "num_experts": 2, "num_local_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
    "image_size": IMAGE, "patch_size": 8, "max_position_embeddings": 128, "num_labels": NUM_LABELS,
    "rotary_dim": 8, "d_head": 16, "d_inner": 64, "emb_dim": 32, "n_layers": 2, "n_heads": 2,
    "d_latents": 32, "num_latents": 16, "num_self_attends_per_block": 2, "num_self_attention_heads": 2,
    "num_cross_attention_heads": 2, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_state": 16,
    "mamba_chunk_size": 16,
}
#: Rules by name suffix for the size fields a config family adds (first match wins): head widths (a rotary part
#: half of it), low ranks, expert counts and groups; they keep every derived width consistent with ``head_dim`` 16.
SUFFIX_SIZES: tuple[tuple[str, int], ...] = (
    ("rope_head_dim", 8), ("head_dim", 16), ("_lora_rank", 16), ("_experts", 2), ("_group", 1),
)
PAD_ID, EOS_ID = 1, 2  # token ids the catalog's inputs never draw at random
_STAGE_DEPTHS = ("depths", "layers", "num_layers_per_stage", "block_repeats", "block_sizes")
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "dims", "widths", "hidden_dims")
_STAGE_HEADS = ("num_heads", "num_attention_heads", "heads")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers")
#: Repeat counts of a model's blocks named apart from its layer count (xLSTM's blocks, HRM's layers per stack): at
#: most the small layer count (never raised: a one-block model stays one block).
_BLOCK_COUNTS = ("num_blocks", "num_layers_per_stack")


def _field_values(config: Any) -> dict[str, Any]:
    """The constructor fields of ``config`` and their values (dataclass fields; else its ``__dict__``)."""
    heterogeneous = getattr(config, "is_heterogeneous", False)  # per-layer values: read the global ones
    with _global_per_layer_access(config) if heterogeneous else contextlib.nullcontext():
        if dataclasses.is_dataclass(config):
            return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and
                    hasattr(config, f.name)}
        return dict(vars(config))


@contextlib.contextmanager
def _global_per_layer_access(config: Any) -> Any:
    """Let a heterogeneous (``per_layer_config``) transformers config answer its per-layer fields globally."""
    before = config.allow_global_per_layer_attribute_access
    config.allow_global_per_layer_attribute_access = True
    try:
        yield
    finally:
        config.allow_global_per_layer_attribute_access = before


def _shrunk_per_layer_config(config: Any, hidden: int | None, layers: int) -> dict[int, dict[str, Any]]:
    """The ``per_layer_config`` of a heterogeneous config for its first ``layers`` layers, each layer's size fields
    shrunk by the same rules as the global ones (so the layers stay consistent with each other)."""
    shrunk: dict[int, dict[str, Any]] = {}
    for index in range(layers):
        layer = config.per_layer_config[index]
        values = {}
        for attr in sorted(config.per_layer_attributes):
            value = getattr(layer, attr)
            small = _small_int(attr, value, hidden, {}) if isinstance(value, int) and not isinstance(value, bool) \
                else None
            values[attr] = value if small is None else small
        shrunk[index] = values
    return shrunk


def _small_int(key: str, value: int, hidden: int | None, widths: dict[int, int]) -> int | None:
    """The small value of scalar field ``key`` (None: keep ``value``); ``widths`` maps old stage widths to new."""
    if key in SMALL_SIZES:
        return SMALL_SIZES[key]
    if key.endswith("_token_id") and value >= VOCAB:  # a special token beyond the shrunk vocabulary
        return {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID}.get(key, 0)
    for suffix, small in SUFFIX_SIZES:
        if key.endswith(suffix):
            return small
    if "channels" in key and value in widths:  # a stem or stage width named apart from the list
        return widths[value]
    if hidden is not None and value == hidden and key.endswith(("hidden_size", "_dim", "_size")):
        return SMALL_SIZES["hidden_size"]  # another name for the model width (a pooler's, an embedding's)
    return None


def _run_length(value: list[Any]) -> int | None:
    """Layers a run-length layer list ``[[pattern, repeats], ...]`` describes (None: not such a list)."""
    if not all(isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], (list, tuple)) and v[0]
               and isinstance(v[1], int) for v in value) or not value:
        return None
    return sum(len(pattern) * repeats for pattern, repeats in value)


def _shrunk_fields(config: Any) -> dict[str, Any]:
    """Field -> small value for every size field of ``config`` (module docstring), sub-configs shrunk too."""
    import transformers

    values = _field_values(config)
    hidden = next((values[k] for k in ("hidden_size", "d_model", "n_embd", "emb_dim")
                   if isinstance(values.get(k), int)), None)
    layers = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    widths: dict[int, int] = {}
    changes: dict[str, Any] = {}
    for key in _STAGE_DEPTHS + _STAGE_WIDTHS + _STAGE_HEADS:
        current = values.get(key)
        if isinstance(current, (list, tuple)) and current and all(isinstance(v, int) for v in current):
            if key in _STAGE_WIDTHS:  # one factor for every stage, so equal widths stay equal
                factor = max(1, current[0] // 16)
                new = [max(8, v // factor) for v in current]
                widths.update(zip(current, new, strict=True))
            else:
                new = [1] * len(current)
            changes[key] = type(current)(new)
    for key, value in values.items():
        if key in changes:
            continue
        if isinstance(value, transformers.PretrainedConfig):
            changes[key] = shrink_config(value)
        elif value is None and key in SMALL_SIZES and key != "num_labels":
            changes[key] = SMALL_SIZES[key]  # a size the config leaves unset (None) but its model reads
        elif key in _BLOCK_COUNTS and isinstance(value, int) and value > SMALL_SIZES["num_hidden_layers"]:
            changes[key] = SMALL_SIZES["num_hidden_layers"]
        elif isinstance(value, int) and not isinstance(value, bool):
            small = _small_int(key, value, hidden, widths)
            if small is not None and small != value:
                changes[key] = small
        elif isinstance(value, list) and layers and len(value) == layers and len(value) > 2:
            changes[key] = value[:SMALL_SIZES["num_hidden_layers"]]  # per-layer lists (layer_types, ...)
        elif isinstance(value, list) and layers and _run_length(value) == layers:
            pattern = value[0][0]  # [[pattern, repeats], ...]: the first pattern, repeated to the layer count
            changes[key] = [[pattern, max(1, SMALL_SIZES["num_hidden_layers"] // len(pattern))]]
    small_layers = SMALL_SIZES["num_hidden_layers"]
    for key, value in values.items():  # a count of some of the layers (shared-cache ones, ...) scales with them
        if (layers and key.endswith("_layers") and key not in _LAYER_COUNTS and key not in changes
                and isinstance(value, int) and not isinstance(value, bool) and 0 < value < layers):
            changes[key] = value * small_layers // layers
    if getattr(config, "is_heterogeneous", False) and layers:
        changes["per_layer_config"] = _shrunk_per_layer_config(config, hidden, small_layers)
    for key, value in values.items():  # the LM head is the largest matmul of a small decoder (and per-layer tables)
        if key.startswith("vocab_size") and isinstance(value, int) and value > VOCAB:
            changes[key] = VOCAB
    if "vocab_size" in values:
        changes["vocab_size"] = VOCAB
    if "pad_token_id" in values and values["pad_token_id"] is None:
        changes["pad_token_id"] = PAD_ID  # sequence classifiers find each row's last token by it
    if "eos_token_id" in values:
        changes["eos_token_id"] = EOS_ID  # encoder-decoder classifiers pool at the end-of-sequence token
    for attr in ("use_cache", "output_attentions", "output_hidden_states"):
        if attr in values:
            changes[attr] = False
    return changes


def shrink_config(config: Any) -> Any:
    """A copy of ``config`` with its size fields small (module docstring), built through its constructor.

    Building anew (not setting attributes) lets the config recompute what it derives from the sizes (a head width
    from the rope and no-rope parts, per-layer lists' checks); sub-configs (a vision tower's) are shrunk the same way.
    """
    changes = _shrunk_fields(config)
    if dataclasses.is_dataclass(config):
        kept = {k: v for k, v in _field_values(config).items() if k not in changes}
        small = type(config)(**{**kept, **changes})
        small.num_labels = NUM_LABELS  # a property (it sizes id2label), not a field
        return small
    for key, value in changes.items():
        with contextlib.suppress(AttributeError, NotImplementedError):
            setattr(config, key, value)
    return config


def config_for(config: Any, wanted: type) -> Any:
    """``config`` if the model class takes its type, else its sub-config of the type the class takes (a composite
    config's decoder, for a causal LM built on the decoder alone), else the class's own default config."""
    if isinstance(config, wanted):
        return config
    with contextlib.nullcontext() if not getattr(config, "is_heterogeneous", False) else \
            _global_per_layer_access(config):
        found = [v for v in vars(config).values() if isinstance(v, wanted)]
    return found[0] if found else wanted()
