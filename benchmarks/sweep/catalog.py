"""What the sweep runs: model types from ``transformers``' own auto mappings and one model per ``timm`` family.

Nothing here names an architecture; every setup rule is keyed by a config field, so a failure in the table is the
library's (or torch's), not the catalog's. ``transformers`` types come from the auto mappings (sequence
classification, image classification, audio classification, causal LM), each with the library's default config
rebuilt small through its constructor (:func:`shrink_config`): the size fields it has are set small
(:data:`SMALL_SIZES`, :data:`SUFFIX_SIZES`: head parts, low ranks, experts), stage lists get one block per stage and
widths divided by one factor (the first becomes 16; a ``*channels`` field equal to a stage width follows it), another
name for the model width follows ``hidden_size``, per-layer lists follow the layer count (and a count of some of the
layers scales with it; a heterogeneous ``per_layer_config`` shrinks layer by layer), sub-configs shrink the same
way (a model class built on one sub-config, a causal LM on a composite config's decoder, gets that one), every
vocabulary is :data:`VOCAB`, and the special tokens the heads read exist (a pad token; every input row ends
in one end-of-sequence token). A model that asks for a default language gets the config's first.
``timm`` families are the modules of ``timm.list_models()``; each runs the variant with the fewest parameters among
its smallest-named (:data:`SIZE_ORDER`, :func:`smallest_timm_variants`), ``pretrained=False``, at a reduced
resolution and, where the architecture takes one, a depth of 2 blocks (:data:`TIMM_SHRINK`).
Every entry is a :class:`benchmarks.corpus.models.CorpusModel`, so :func:`benchmarks.corpus.runner.run_corpus_model`
runs it beside ``quantize_static``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from benchmarks.corpus.models import CorpusModel, SingleInput, TokenClassifierInputs, images
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["SIZE_ORDER", "SMALL_SIZES", "SUFFIX_SIZES", "TIMM_SHRINK", "entry_named", "hf_entries", "shrink_config",
           "smallest_timm_variants", "sweep_entries", "timm_entries", "timm_families", "timm_parameters",
           "timm_resolution"]

NUM_LABELS = 4
SEQ = 16
TOKEN_IDS = 100  # inputs draw ids from [3, TOKEN_IDS): clear of the special ids 0, PAD_ID, EOS_ID
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
    "rotary_dim": 8, "d_head": 16, "d_inner": 64,
}
#: Rules by name suffix for the size fields a config family adds (first match wins): head widths (a rotary part
#: half of it), low ranks, expert counts and groups; they keep every derived width consistent with ``head_dim`` 16.
SUFFIX_SIZES: tuple[tuple[str, int], ...] = (
    ("rope_head_dim", 8), ("head_dim", 16), ("_lora_rank", 16), ("_experts", 2), ("_group", 1),
)
PAD_ID, EOS_ID = 1, 2  # token ids the inputs never draw at random (they draw from [3, TOKEN_IDS))
_STAGE_DEPTHS = ("depths", "layers", "num_layers_per_stage", "block_repeats", "block_sizes")
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "dims", "widths", "hidden_dims")
_STAGE_HEADS = ("num_heads", "num_attention_heads", "heads")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "decoder_layers", "encoder_layers")


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
    hidden = next((values[k] for k in ("hidden_size", "d_model", "n_embd") if isinstance(values.get(k), int)), None)
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


#: Size arguments tried in order for a timm model: transformers take a resolution and a depth, CNNs neither.
TIMM_SHRINK: tuple[dict[str, int], ...] = ({"img_size": IMAGE, "depth": 2}, {"img_size": IMAGE}, {})

#: Smallest-named variants of a timm family whose parameters are counted to choose the smallest.
TIMM_CANDIDATES = 4
#: Where the chosen variants are cached (:func:`smallest_timm_variants`).
TIMM_CHOICE = Path(__file__).resolve().parent / "timm_smallest.json"

#: Size words in timm model names, smallest first (a family runs the first variant in this order).
SIZE_ORDER = ("atto", "femto", "pico", "nano", "micro", "xxs", "xs", "tiny", "mini", "small", "s", "b0", "050",
              "075", "100", "18", "base", "medium", "m", "large", "l", "huge", "xl", "giant")


def _tokens(gen: torch.Generator, batch: int) -> tuple[Tensor, Tensor]:
    """Right-padded rows of ids in ``[3, TOKEN_IDS)``, each ending in one :data:`EOS_ID` (the first row unpadded)."""
    ids = torch.randint(3, TOKEN_IDS, (batch, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    lengths[0] = SEQ
    ids[torch.arange(batch), lengths - 1] = EOS_ID
    return ids, (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()


def _audio(gen: torch.Generator, batch: int) -> tuple[Tensor]:
    return (0.1 * torch.randn(batch, 1600, generator=gen),)


def _config_for(config: Any, wanted: type) -> Any:
    """``config`` if the model class takes its type, else its sub-config of the type the class takes (a composite
    config's decoder, for a causal LM built on the decoder alone), else the class's own default config."""
    if isinstance(config, wanted):
        return config
    with contextlib.nullcontext() if not getattr(config, "is_heterogeneous", False) else \
            _global_per_layer_access(config):
        found = [v for v in vars(config).values() if isinstance(v, wanted)]
    return found[0] if found else wanted()


def _hf_build(model_type: str, class_name: str, wrap: Callable[[nn.Module], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import transformers

        model_class = getattr(transformers, class_name)
        config = shrink_config(_config_for(transformers.AutoConfig.for_model(model_type), model_class.config_class))
        model = model_class(config)
        languages = getattr(config, "languages", None)
        if hasattr(model, "set_default_language") and languages:  # adapters per language need one chosen
            model.set_default_language(languages[0])
        return randomize_batchnorm(wrap(model)).eval()

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


def _timm_create(arch: str, size: int = IMAGE) -> nn.Module:
    """``arch`` with the first set of :data:`TIMM_SHRINK` size arguments it accepts (on the current device), the
    resolution set to ``size`` where the architecture takes one."""
    import timm

    for extra in TIMM_SHRINK[:-1]:
        try:
            return timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS,
                                     **{**extra, **({"img_size": size} if "img_size" in extra else {})})
        except TypeError:
            continue
    return timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS, **TIMM_SHRINK[-1])


def _timm_size_step(model: nn.Module) -> int:
    """The input size ``model``'s resolution must be a multiple of: its patch size and its last feature stride
    (their least common multiple; 1 when it names neither)."""
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    patch = max(patch) if isinstance(patch, (tuple, list)) else patch
    info = getattr(model, "feature_info", None)
    reduction = info[-1].get("reduction") if isinstance(info, list) and info and isinstance(info[-1], dict) else None
    return math.lcm(*(int(v) for v in (patch, reduction) if isinstance(v, int) and v > 0)) or 1


def _timm_runs_at(arch: str, size: int) -> bool:
    """Whether ``arch`` built for ``size`` runs a ``size`` x ``size`` image (on the meta device: shapes only)."""
    with warnings.catch_warnings(), torch.device("meta"), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            _timm_create(arch, size)(torch.empty(1, 3, size, size))
        except Exception:  # noqa: BLE001 - any failure means "not at this size"
            return False
    return True


@functools.cache
def timm_resolution(arch: str) -> int:
    """The smallest input size ``arch`` runs at: :data:`IMAGE` if it runs there, else the first multiple of its size
    step (:func:`_timm_size_step`: its patch size and last feature stride) above :data:`IMAGE` that runs, up to its
    ``pretrained_cfg``'s default ``input_size``, which is the fallback. Sizes are tried on the meta device
    (shapes only, a fraction of a second each).

    Halo attention needs every feature map divisible by its block size, a patch embedding a multiple of its patch,
    an Inception stem a large enough image: the model's config and shapes say what works, no table does.
    """
    declare_torchvision_ops()
    from timm.models import get_pretrained_cfg

    if _timm_runs_at(arch, IMAGE):
        return IMAGE
    cfg = get_pretrained_cfg(arch)
    default = int(cfg.input_size[-1]) if cfg is not None and cfg.input_size else IMAGE
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        step = _timm_size_step(_timm_create(arch, IMAGE))
    size = (IMAGE // step + 1) * step
    while size < default:
        if _timm_runs_at(arch, size):
            return size
        size += step
    return default


def timm_parameters(arch: str) -> int:
    """Parameters of ``arch`` as the sweep builds it (shrunk), counted on the meta device (no memory, no init)."""
    declare_torchvision_ops()
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return sum(p.numel() for p in _timm_create(arch).parameters())


def _timm_build(arch: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        return randomize_batchnorm(_timm_create(arch, timm_resolution(arch))).eval()

    return build


def _timm_images(arch: str) -> Callable[[torch.Generator, int], tuple[Tensor]]:
    """Images at :func:`timm_resolution` (found on the first batch drawn, not when the catalog is listed)."""
    return lambda gen, batch: images(timm_resolution(arch))(gen, batch)


def _timm_entry(family: str, arch: str) -> CorpusModel:
    return CorpusModel(f"timm-{family}-{arch}", "timm", _timm_build(arch), _timm_images(arch), ("x",), "classifier")


def timm_families() -> dict[str, list[str]]:
    """``timm`` model module -> its model names, smallest-named first (:data:`SIZE_ORDER`)."""
    declare_torchvision_ops()
    import timm
    from timm.models import _registry

    families: dict[str, list[str]] = {}
    for name in timm.list_models():
        families.setdefault(_registry._model_to_module.get(name, name), []).append(name)
    return {family: sorted(names, key=_size_rank) for family, names in sorted(families.items())}


def smallest_timm_variants(cache: Path = TIMM_CHOICE) -> dict[str, str]:
    """Family -> the variant with the fewest parameters (shrunk) among its :data:`TIMM_CANDIDATES` smallest-named.

    Counting takes about a second per model, so the choice is kept in ``cache`` (JSON, keyed by the timm version and
    the family list) and recounted only when either changes.
    """
    declare_torchvision_ops()
    import timm

    families = timm_families()
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(cache.read_text())
        if saved["timm"] == timm.__version__ and sorted(saved["families"]) == sorted(families):
            return {family: saved["families"][family]["arch"] for family in families}
    chosen: dict[str, dict[str, object]] = {}
    for family, names in families.items():
        counts = {}
        for arch in names[:TIMM_CANDIDATES]:
            with contextlib.suppress(Exception):  # a variant that does not build at this size is not a candidate
                counts[arch] = timm_parameters(arch)
        arch = min(counts, key=counts.__getitem__) if counts else names[0]
        chosen[family] = {"arch": arch, "parameters": counts.get(arch)}
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"timm": timm.__version__, "candidates": TIMM_CANDIDATES, "families": chosen},
                                    indent=1, sort_keys=True) + "\n")
    return {family: str(c["arch"]) for family, c in chosen.items()}


def timm_entries() -> list[CorpusModel]:
    """One entry per ``timm`` model module: its smallest variant (:func:`smallest_timm_variants`)."""
    return [_timm_entry(family, arch) for family, arch in smallest_timm_variants().items()]


def entry_named(name: str) -> CorpusModel:
    """The sweep entry called ``name`` without enumerating the catalog (a child process runs one model)."""
    if name.startswith("timm-"):
        family, _, arch = name[len("timm-"):].partition("-")  # module names have no hyphen
        if arch:
            return _timm_entry(family, arch)
    for entry in hf_entries():
        if entry.name == name:
            return entry
    raise KeyError(f"no sweep entry is called {name!r}")


def sweep_entries() -> list[CorpusModel]:
    """Every sweep entry, in a fixed order (timm families first, then transformers types)."""
    return timm_entries() + hf_entries()
