"""``prepare``'s warnings for config entries that match nothing in the model (a typo quantizes nothing silently).

One ``UserWarning`` per level with unmatched entries:

* ``module_name`` patterns that fullmatch no qualified module name;
* ``module_type`` keys that are neither the class nor a base class of any module of the model;
* ``op_kind`` keys that are the kind of no node of the captured graph (before BatchNorm / attention-scale folding);
* a config that put no quantizer anywhere (the prepared model would run entirely in float).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from coreai_opt.config import OP_KINDS, QuantizerConfig

__all__ = ["warn_unmatched_entries"]


def warn_unmatched_entries(
    config: QuantizerConfig, model: nn.Module, op_kinds: Iterable[str], num_quantizers: int, stacklevel: int
) -> None:
    """Warn about every entry of ``config`` matching nothing in ``model``, and about a config quantizing nothing.

    Args:
        config: The config passed to ``prepare``.
        model: The float model.
        op_kinds: The op kinds of the captured graph's nodes.
        num_quantizers: Quantizers ``prepare`` inserted.
        stacklevel: ``warnings.warn`` stack level of the user's ``prepare`` call, seen from here.
    """
    model_name = type(model).__name__
    kinds = sorted(set(op_kinds))
    unused_names = config.unused_module_name_patterns(name for name, _ in model.named_modules())
    unused_types = config.unused_module_types({type(m) for m in model.modules()})
    unused_kinds = config.unused_op_kinds(kinds)
    messages = []
    if unused_names:
        messages.append(
            f"module_name pattern(s) {unused_names} match no module of {model_name}; check the regex "
            "(it must fullmatch a qualified name such as 'layer1\\.0\\.conv1')"
        )
    if unused_types:
        messages.append(
            f"module_type key(s) {unused_types} match no module of {model_name} (subclasses match too); check the "
            "class, or drop the entry"
        )
    if unused_kinds:
        present = ", ".join(k for k in kinds if k in OP_KINDS) or "none a config can address"
        messages.append(
            f"op_kind key(s) {unused_kinds} match no op of {model_name} (its op kinds: {present}); check the kind, "
            "or drop the entry"
        )
    if num_quantizers == 0:
        messages.append(
            f"the config quantizes nothing in {model_name}: no weight or activation got a quantizer, so the prepared "
            "model runs in float; start from a preset (QuantizerConfig.presets.w8a8()) or check the entries"
        )
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
