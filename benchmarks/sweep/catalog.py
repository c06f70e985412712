"""What the sweep runs: model types from ``transformers``' own auto mappings and one model per ``timm`` family.

Nothing here names an architecture; every setup rule is keyed by a config field, so a failure in the table is the
library's (or torch's), not the catalog's. ``transformers`` types come from the auto mappings (sequence
classification, image classification, audio classification, causal LM), each with the library's default config
rebuilt small (:mod:`benchmarks.sweep.small_config`; a model class built on one sub-config gets that one); every
input row ends in one end-of-sequence token, and a model that asks for a default language gets the config's first.
``timm`` families are the modules of ``timm.list_models()``; each runs the variant with the fewest parameters among
its smallest-named (:data:`SIZE_ORDER`, :func:`smallest_timm_variants`), ``pretrained=False``, at the smallest
resolution it runs at from 64 px (:func:`timm_resolution`) and, where the architecture takes one, a depth of 2
blocks (:data:`TIMM_SHRINK`).
Every entry is a :class:`benchmarks.corpus.models.CorpusModel`, so :func:`benchmarks.corpus.runner.run_corpus_model`
runs it beside ``quantize_static``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from benchmarks.corpus.models import CorpusModel, SingleInput, TokenClassifierInputs, images
from benchmarks.sweep.small_config import (
    EOS_ID,
    IMAGE,
    NUM_LABELS,
    PAD_ID,
    SMALL_SIZES,
    SUFFIX_SIZES,
    VOCAB,
    config_for,
    shrink_config,
)
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["EOS_ID", "IMAGE", "NUM_LABELS", "PAD_ID", "SIZE_ORDER", "SMALL_SIZES", "SUFFIX_SIZES", "TIMM_SHRINK",
           "VOCAB", "entry_named", "hf_entries", "shrink_config",
           "smallest_timm_variants", "sweep_entries", "timm_entries", "timm_families", "timm_parameters",
           "timm_resolution"]

SEQ = 16
TOKEN_IDS = 100  # inputs draw ids from [3, TOKEN_IDS): clear of the special ids 0, PAD_ID, EOS_ID


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


def _hf_build(model_type: str, class_name: str, wrap: Callable[[nn.Module], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import transformers

        model_class = getattr(transformers, class_name)
        config = shrink_config(config_for(transformers.AutoConfig.for_model(model_type), model_class.config_class))
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
