"""What the sweep runs: model types from ``transformers``' own auto mappings and one model per ``timm`` family.

Nothing here names an architecture. ``transformers`` types come from the auto mappings (sequence classification,
image classification, audio classification, causal LM), each with the library's default config shrunk
generically: every size field the config has is set small (:data:`SMALL_SIZES`), list-valued stage fields get one
block per stage and widths ``16·2^i``. ``timm`` families are the modules of ``timm.list_models()``; each family
runs its smallest-named variant (:data:`SIZE_ORDER`) with ``pretrained=False`` at a reduced resolution and, where
the architecture takes one, a depth of 2 blocks (:data:`TIMM_SHRINK`).
Every entry is a :class:`benchmarks.corpus.models.CorpusModel`, so :func:`benchmarks.corpus.runner.run_corpus_model`
runs it beside ``quantize_static``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from benchmarks.corpus.models import CorpusModel, SingleInput, TokenClassifierInputs, images
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["SIZE_ORDER", "SMALL_SIZES", "TIMM_SHRINK", "hf_entries", "shrink_config", "sweep_entries", "timm_entries"]

NUM_LABELS = 4
SEQ = 16
TOKEN_IDS = 100  # ids below every default vocabulary and clear of most special-token ids' meaning
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
}
_STAGE_DEPTHS = ("depths", "layers", "num_layers_per_stage", "block_repeats")
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "dims", "widths", "hidden_dims")
_STAGE_HEADS = ("num_heads", "num_attention_heads", "heads")

#: Size arguments tried in order for a timm model: transformers take a resolution and a depth, CNNs neither.
TIMM_SHRINK: tuple[dict[str, int], ...] = ({"img_size": IMAGE, "depth": 2}, {"img_size": IMAGE}, {})

#: Size words in timm model names, smallest first (a family runs the first variant in this order).
SIZE_ORDER = ("atto", "femto", "pico", "nano", "micro", "xxs", "xs", "tiny", "mini", "small", "s", "b0", "050",
              "075", "100", "18", "base", "medium", "m", "large", "l", "huge", "xl", "giant")


def shrink_config(config: Any) -> Any:
    """Set the size fields ``config`` has to small values (module docstring); returns ``config``."""
    for key, value in SMALL_SIZES.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool):
            setattr(config, key, value)
    for key in _STAGE_DEPTHS + _STAGE_WIDTHS + _STAGE_HEADS:
        current = getattr(config, key, None)
        if isinstance(current, (list, tuple)) and current and all(isinstance(v, int) for v in current):
            n = len(current)
            new = [1] * n if key in _STAGE_DEPTHS + _STAGE_HEADS else [16 * 2**i for i in range(n)]
            setattr(config, key, type(current)(new))
    for attr in ("use_cache", "output_attentions", "output_hidden_states"):
        if hasattr(config, attr):
            setattr(config, attr, False)
    return config


def _tokens(gen: torch.Generator, batch: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(3, TOKEN_IDS, (batch, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    lengths[0] = SEQ
    return ids, (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()


def _audio(gen: torch.Generator, batch: int) -> tuple[Tensor]:
    return (0.1 * torch.randn(batch, 1600, generator=gen),)


def _hf_build(model_type: str, class_name: str, wrap: Callable[[nn.Module], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import transformers

        config = shrink_config(transformers.AutoConfig.for_model(model_type))
        return randomize_batchnorm(wrap(getattr(transformers, class_name)(config))).eval()

    return build


def hf_entries() -> list[CorpusModel]:
    """One entry per model type of each task mapping (the first mapping that lists a type wins)."""
    declare_torchvision_ops()
    from transformers.models.auto import modeling_auto as auto

    tasks = (
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "encoder", _tokens, ("input_ids", "attention_mask"),
         "classifier", TokenClassifierInputs),
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "vision", images(IMAGE), ("pixel_values",), "classifier",
         lambda m: SingleInput(m, "pixel_values")),
        ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "speech", _audio, ("input_values",), "classifier",
         lambda m: SingleInput(m, "input_values")),
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "decoder", _tokens, ("input_ids", "attention_mask"), "lm",
         TokenClassifierInputs),
    )
    seen: set[str] = set()
    entries = []
    for mapping, family, inputs, names, output, wrap in tasks:
        for model_type, class_name in getattr(auto, mapping).items():
            if model_type in seen or not isinstance(class_name, str):
                continue
            seen.add(model_type)
            entries.append(CorpusModel(f"hf-{model_type}", family, _hf_build(model_type, class_name, wrap), inputs,
                                       names, output))
    return entries


def _size_rank(name: str) -> tuple[int, int, str]:
    words = re.split(r"[_\-.]", name.lower())
    ranks = [SIZE_ORDER.index(w) for w in words if w in SIZE_ORDER]
    return (min(ranks) if ranks else len(SIZE_ORDER), len(name), name)


def _timm_build(arch: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import timm

        for extra in TIMM_SHRINK[:-1]:  # the first set of size arguments the architecture accepts
            try:
                return randomize_batchnorm(timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS,
                                                             **extra)).eval()
            except TypeError:
                continue
        model = timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS, **TIMM_SHRINK[-1])
        return randomize_batchnorm(model).eval()

    return build


def timm_entries() -> list[CorpusModel]:
    """One entry per ``timm`` model module: its smallest-named variant (:data:`SIZE_ORDER`)."""
    declare_torchvision_ops()
    import timm
    from timm.models import _registry

    families: dict[str, list[str]] = {}
    for name in timm.list_models():
        families.setdefault(_registry._model_to_module.get(name, name), []).append(name)
    return [CorpusModel(f"timm-{family}-{min(names, key=_size_rank)}", "timm", _timm_build(min(names, key=_size_rank)),
                        images(IMAGE), ("x",), "classifier") for family, names in sorted(families.items())]


def sweep_entries() -> list[CorpusModel]:
    """Every sweep entry, in a fixed order (timm families first, then transformers types)."""
    return timm_entries() + hf_entries()
