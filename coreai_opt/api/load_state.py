"""``load_state_dict``: load a saved prepared / converted state after checking every quantizer's spec.

Each ``FakeQuantize`` saves its spec as ``<prefix>_extra_state``. ``torch.nn.Module.load_state_dict`` stops at
the first quantizer whose spec differs; this helper compares all of them first and raises one error listing
every mismatched, missing and unexpected quantizer, then loads with ``strict=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.fake_quantize.fake_quantize import spec_summary

__all__ = ["load_state_dict"]

_EXTRA = "_extra_state"
_FLAG = "observer_enabled"  # a FakeQuantize-only buffer: marks a saved quantizer even without extra state


def _saved_quantizer_prefixes(state_dict: Mapping[str, Any]) -> set[str]:
    prefixes = set()
    for key in state_dict:
        for leaf in (_EXTRA, _FLAG):
            if key == leaf or key.endswith(f".{leaf}"):
                prefixes.add(key[: -len(leaf)].removesuffix("."))
    return prefixes


@public_api
def load_state_dict(prepared: nn.Module, state_dict: Mapping[str, Any]) -> nn.Module:
    """Load ``state_dict`` into ``prepared`` after checking that every quantizer was saved with the same spec.

    Args:
        prepared: A model returned by ``prepare`` (or ``convert``), built with the config used when saving.
        state_dict: A state saved from such a model (``model.state_dict()``).

    Returns:
        ``prepared`` itself, loaded (``strict=True``).

    Raises:
        ValueError: one or more quantizers differ between the saved state and ``prepared``: saved with another
            spec, missing from the state, or in the state but not in the model (each listed as
            ``name: saved → current``).
        RuntimeError: other ``strict=True`` key or shape mismatches (from ``torch``).
    """
    current = {path: fq for path, fq in fake_quantizers(prepared)}
    saved = _saved_quantizer_prefixes(state_dict)
    problems = []
    for path, fq in current.items():
        label = f"{fq.name} ({path})" if path and fq.name != path else (path or fq.name)
        spec = fq.spec.to_dict()
        key = f"{path}.{_EXTRA}" if path else _EXTRA
        if path not in saved:
            problems.append(f"{label}: missing from the state_dict → {spec_summary(spec)}")
        elif key not in state_dict:
            problems.append(f"{label}: saved without a spec (older coreai_opt) → {spec_summary(spec)}")
        elif state_dict[key] != spec:
            problems.append(
                f"{label}: {spec_summary(state_dict[key], spec)} → "
                f"{spec_summary(spec, state_dict[key] if isinstance(state_dict[key], dict) else None)}"
            )
    for path in sorted(saved - set(current)):
        key = f"{path}.{_EXTRA}" if path else _EXTRA
        summary = spec_summary(state_dict[key]) if key in state_dict else "a quantizer"
        problems.append(f"{path}: {summary} → not in this model")
    if problems:
        raise ValueError(
            f"the state_dict does not match this model's quantizers ({len(problems)}):\n  "
            + "\n  ".join(problems)
            + "\nprepare with the config used when saving (prepared.meta['coreai_opt']['config']) and the same "
            "model, then load again"
        )
    prepared.load_state_dict(dict(state_dict), strict=True)
    return prepared
