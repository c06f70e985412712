r"""``QuantizerConfig``: which tensors get quantized with which :class:`QuantizationSpec`.

A config has four precedence levels, highest first::

    module_name  (regex, re.fullmatch on the module's qualified name, e.g. "layer1\.0\.conv1")
    module_type  (a torch.nn.Module class; subclasses match too)
    op_kind      ("conv", "linear", "add", ... see OP_KINDS)
    global       (QuantizerConfig.weight / QuantizerConfig.activation)

Each level maps keys to an :class:`OpConfig` (or to ``None``). ``weight`` and ``activation`` are resolved
independently: for each of them, the highest level whose matching entry *sets* the field wins.

Three states per field
======================

``OpConfig`` distinguishes, for ``weight`` and for ``activation``:

* **unset** (the field was not passed): inherit from the next lower level;
* **set to None**: leave the tensor in float at this level (lower levels are ignored);
* **set to a spec**: quantize with that spec.

The distinction is pydantic's ``model_fields_set``: ``OpConfig(weight=spec)`` sets only ``weight``,
``OpConfig(weight=spec, activation=None)`` also pins activations to float. ``OpConfig.is_set(field)`` reads it,
``to_dict()`` only writes set fields, and equality takes it into account. A whole entry of ``None``
(``set_op_kind("softmax", None)``) means "everything float" at that level.

Ordering within a level
=======================

* ``module_name``: when several regexes match one module, later entries win (insertion order; a setter
  call on an existing key moves it to the end, so the most recent call wins).
* ``module_type``: the configured class nearest in the module's MRO wins (its own class before its bases).
  Keys that name the same class (``"torch.nn.Conv2d"`` and ``"torch.nn.modules.conv.Conv2d"``) are merged,
  the later one winning.

Mutation
========

``QuantizerConfig`` is a mutable pydantic model (``validate_assignment=True``). The chainable setters
(``set_global``, ``set_op_kind``, ``set_module_type``, ``set_module_name``) validate, modify the config in
place and return ``self``, so both ``cfg.set_op_kind(...)`` and ``cfg = cfg.set_op_kind(...).set_...(...)``
work. Use ``cfg.model_copy(deep=True)`` for an independent copy. Mutate through the setters (or by assigning
whole fields); editing the dicts in place bypasses validation.

Where the parts live: :mod:`~coreai_opt.config.op_config` (``OpConfig``), :mod:`~coreai_opt.config.level_keys`
(the keys of each level, checked), :mod:`~coreai_opt.config.resolution` (``resolve``),
:mod:`~coreai_opt.config.coercion` (values from and to plain dicts) and :mod:`~coreai_opt.config.presets`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from coreai_opt.config.coercion import check_keys, require_mapping, spec_from_value, spec_to_dict
from coreai_opt.config.level_keys import normalize_level, validate_op_kind, validate_regex
from coreai_opt.config.module_types import normalize_module_type, qualified_name
from coreai_opt.config.op_config import OpConfig
from coreai_opt.config.resolution import ResolvedSpecs, resolve_specs
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.spec import QuantizationSpec

# OpConfig is imported from here too (coreai_opt.config.quantizer_config.OpConfig), so it stays in __all__.
__all__ = ["UNSET", "OpConfig", "QuantizerConfig"]


class _Unset(Enum):
    """Type of :data:`UNSET`, the "argument not given" marker of :meth:`QuantizerConfig.set_global`."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


#: Default of :meth:`QuantizerConfig.set_global` arguments: "leave this field as it is" (``None`` means float).
UNSET = _Unset.UNSET


class QuantizerConfig(BaseModel):
    """The quantization config passed to ``prepare``.

    Start from a preset (``QuantizerConfig.presets.w8a8()``) or build one; ``QuantizerConfig()`` quantizes
    nothing (global weight and activation are None = float).

    Attributes:
        weight: Global weight spec (None = float weights).
        activation: Global activation spec (None = float activations).
        op_kind: Per op kind entries; keys from :data:`OP_KINDS`.
        module_type: Per module class entries; keys normalised to ``module.qualname`` (classes accepted).
        module_name: Per module name entries; keys are regexes matched with ``re.fullmatch``.
        int32_bias: Quantize conv/linear biases to int32 with scale ``s_in * s_w`` when both the input and the
            weight are quantized.
        fold_batchnorm: Fold BatchNorm into the preceding conv/linear before inserting quantizers.
        fold_attention_scale: Fold the constant scale of attention scores (``q @ kᵀ / sqrt(d)``) into the
            query projection's weight and bias, removing a quantize/dequantize/div step per attention block
            (:mod:`coreai_opt.passes.fold_attention_scale`).
        fold_channel_scales: Fold a constant per-channel multiply of a conv / linear output (layer scale,
            ``x * gamma``) into its weight and bias, removing a ``QLinearMul`` and a rounding per block
            (:mod:`coreai_opt.passes.fold_channel_scales`; post-training only, QAT keeps the multiply).
        fixed_range_outputs: softmax outputs use the fixed range [0, 1], its upper end shrunk to a power-of-two
            step (uint8: [0, 255/256], which onnxruntime's ``QLinearSoftmax`` reproduces bit for bit), instead of
            a calibrated range. Sigmoid / tanh outputs are calibrated either way: their calibrated range lies
            inside [0, 1] / [-1, 1] and is often much narrower (a squeeze-excite gate).
        per_block_fallback: What to do with a per-block weight spec whose block size does not divide the
            weight's blocked dimension (e.g. a 3-channel stem conv under block 32): ``"error"`` (prepare raises,
            listing every such layer) or ``"per_channel"`` (that layer uses per-output-channel scales instead,
            with a warning listing the layers).
        kv_cache: Spec of a KV-cache decoder's cache (``DecoderWithCache``, ``--task text-generation``), or None
            (float cache). Each layer's appended keys and values get a calibrated quantizer of this spec
            (:mod:`coreai_opt.passes.quantize_kv_cache`) and the ONNX file stores the cache as its codes;
            :func:`coreai_opt.config.presets.int8_kv_cache` is onnxruntime's per-head, per-channel int8 cache.

    Example:
        >>> cfg = QuantizerConfig.presets.w8a8().set_op_kind("softmax", None)
        >>> cfg.resolve("softmax", "attn.softmax", None).activation is None
        True
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: Preset namespace (``w8``, ``w4``, ``w8a8``, ...), attached by :mod:`coreai_opt.config.presets`.
    presets: ClassVar[Any]

    weight: QuantizationSpec | None = None
    activation: QuantizationSpec | None = None
    op_kind: dict[str, OpConfig | None] = Field(default_factory=dict)
    module_type: dict[str, OpConfig | None] = Field(default_factory=dict)
    module_name: dict[str, OpConfig | None] = Field(default_factory=dict)
    int32_bias: StrictBool = True
    fold_batchnorm: StrictBool = True
    fold_attention_scale: StrictBool = True
    fold_channel_scales: StrictBool = True
    fixed_range_outputs: StrictBool = True
    per_block_fallback: Literal["error", "per_channel"] = "error"
    kv_cache: QuantizationSpec | None = None

    @field_validator("weight", "activation", "kv_cache", mode="before")
    @classmethod
    def _coerce_global_spec(cls, value: Any, info: Any) -> QuantizationSpec | None:
        return spec_from_value(value, f"QuantizerConfig.{info.field_name}")

    @field_validator("op_kind", "module_type", "module_name", mode="before")
    @classmethod
    def _coerce_level(cls, value: Any, info: Any) -> dict[str, OpConfig | None]:
        return normalize_level(info.field_name, value)

    # ---- chainable setters ---------------------------------------------------------------------------------

    @public_api
    def set_global(
        self,
        *,
        weight: QuantizationSpec | None | _Unset = UNSET,
        activation: QuantizationSpec | None | _Unset = UNSET,
    ) -> QuantizerConfig:
        """Set the global weight and/or activation spec in place; arguments left out are unchanged.

        Args:
            weight: Global weight spec, or None for float weights.
            activation: Global activation spec, or None for float activations.

        Returns:
            ``self``, for chaining.
        """
        if weight is not UNSET:
            self.weight = weight
        if activation is not UNSET:
            self.activation = activation
        return self

    @public_api
    def set_op_kind(self, kind: str, config: OpConfig | None) -> QuantizerConfig:
        """Set (or replace) the entry for op kind ``kind``; None keeps that kind entirely in float.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: ``kind`` is not in :data:`OP_KINDS` (the message lists them).
        """
        self.op_kind = self._with_entry(self.op_kind, validate_op_kind(kind), config)
        return self

    @public_api
    def set_module_type(self, module_type: type | str, config: OpConfig | None) -> QuantizerConfig:
        """Set (or replace) the entry for a module class (subclasses match too); None keeps it in float.

        Args:
            module_type: A ``torch.nn.Module`` subclass or its fully qualified name (``"torch.nn.Conv2d"``).
            config: The entry.

        Returns:
            ``self``, for chaining.
        """
        self.module_type = self._with_entry(self.module_type, normalize_module_type(module_type), config)
        return self

    @public_api
    def set_module_name(self, pattern: str, config: OpConfig | None) -> QuantizerConfig:
        """Set (or replace) the entry for module names that ``re.fullmatch`` ``pattern``; None keeps them float.

        The entry moves to the end of ``module_name``, so it wins over every earlier matching pattern.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: ``pattern`` is not a valid regex.
        """
        self.module_name = self._with_entry(self.module_name, validate_regex(pattern), config)
        return self

    @staticmethod
    def _with_entry(level: dict[str, OpConfig | None], key: str, config: OpConfig | None) -> dict[str, OpConfig | None]:
        updated = {k: v for k, v in level.items() if k != key}
        updated[key] = config
        return updated

    # ---- resolution ------------------------------------------------------------------------------------------

    @public_api
    def resolve(self, op_kind: str, module_name: str | None, module_type: type | None) -> ResolvedSpecs:
        """Decide the weight and activation specs of one op.

        Precedence: module name > module type > op kind > global. For weight and activation independently,
        the highest-precedence matching entry that sets the field wins (an entry of None sets both to float).
        Within ``module_name`` later patterns win; within ``module_type`` the nearest class in the MRO wins.

        Args:
            op_kind: The node's op kind, a str or str-valued Enum (kinds outside :data:`OP_KINDS` simply have
                no op-kind entry).
            module_name: Qualified name of the module that owns the op (``"layer1.0.conv1"``), or None.
            module_type: Class of that module, or None.

        Returns:
            The resolved specs and which entry decided them.

        Raises:
            TypeError: Arguments of the wrong type.
        """
        return resolve_specs(self, op_kind, module_name, module_type)

    @public_api
    def unused_module_name_patterns(self, names: Iterable[str]) -> list[str]:
        """Return the ``module_name`` patterns that fullmatch none of ``names`` (in config order).

        Args:
            names: Every module name of the model (e.g. ``[n for n, _ in model.named_modules()]``).

        Raises:
            TypeError: ``names`` is a single string.
        """
        if isinstance(names, str):
            raise TypeError("unused_module_name_patterns expects an iterable of module names, not a single string")
        name_list = list(names)
        return [p for p in self.module_name if not any(re.fullmatch(p, n) for n in name_list)]

    @public_api
    def unused_module_types(self, classes: Iterable[type]) -> list[str]:
        """Return the ``module_type`` keys that are neither of ``classes`` nor a base class of one (config order).

        Args:
            classes: The classes of every module of the model (``{type(m) for m in model.modules()}``).
        """
        present = {qualified_name(base) for cls in classes for base in cls.__mro__}
        return [key for key in self.module_type if key not in present]

    @public_api
    def unused_op_kinds(self, kinds: Iterable[str]) -> list[str]:
        """Return the ``op_kind`` keys not among ``kinds`` (the op kinds of the model's nodes), in config order.

        Raises:
            TypeError: ``kinds`` is a single string.
        """
        if isinstance(kinds, str):
            raise TypeError("unused_op_kinds expects an iterable of op kinds, not a single string")
        present = {k.value if isinstance(k, Enum) else k for k in kinds}
        return [key for key in self.op_kind if key not in present]

    # ---- serialisation ---------------------------------------------------------------------------------------

    @public_api
    def to_dict(self) -> dict[str, Any]:
        """Return a plain JSON/YAML-able dict; :meth:`from_dict` rebuilds an equal config.

        Classes defined inside functions (``<locals>`` in the qualname) cannot be re-imported, so a config
        with such a ``module_type`` key does not survive the round trip.
        """
        return {
            "weight": spec_to_dict(self.weight),
            "activation": spec_to_dict(self.activation),
            "op_kind": self._level_to_dict(self.op_kind),
            "module_type": self._level_to_dict(self.module_type),
            "module_name": self._level_to_dict(self.module_name),
            "int32_bias": self.int32_bias,
            "fold_batchnorm": self.fold_batchnorm,
            "fold_attention_scale": self.fold_attention_scale,
            "fold_channel_scales": self.fold_channel_scales,
            "fixed_range_outputs": self.fixed_range_outputs,
            "per_block_fallback": self.per_block_fallback,
            "kv_cache": spec_to_dict(self.kv_cache),
        }

    @staticmethod
    def _level_to_dict(level: dict[str, OpConfig | None]) -> dict[str, Any]:
        return {k: None if v is None else v.to_dict() for k, v in level.items()}

    @classmethod
    @public_api
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizerConfig:
        """Build from a plain dict (the :meth:`to_dict` layout); absent keys take their defaults.

        Raises:
            ValueError: Unknown key at any level (named, with the valid keys), unknown op kind, invalid regex,
                unimportable module type or invalid spec.
            TypeError: A value of the wrong type.
        """
        data = require_mapping(data, "QuantizerConfig")
        check_keys(data, cls.model_fields, "QuantizerConfig")
        return cls.model_validate(dict(data))

    @classmethod
    @public_api
    def from_yaml(cls, path_or_text: str | os.PathLike[str]) -> QuantizerConfig:
        """Build from YAML text or a YAML file (the :meth:`to_dict` layout).

        Args:
            path_or_text: A ``pathlib.Path``/``os.PathLike``, a one-line string ending in ``.yaml``/``.yml``
                (read as a file path), or YAML text.

        Raises:
            FileNotFoundError: The path does not exist.
            TypeError: The document is not a mapping.
            ValueError: As :meth:`from_dict`.
        """
        if isinstance(path_or_text, os.PathLike) or (
            isinstance(path_or_text, str)
            and "\n" not in path_or_text
            and path_or_text.strip().endswith((".yaml", ".yml"))
        ):
            text = Path(path_or_text).read_text(encoding="utf-8")
        elif isinstance(path_or_text, str):
            text = path_or_text
        else:
            raise TypeError(f"from_yaml expects YAML text or a path, got {type(path_or_text).__name__}")
        data = yaml.safe_load(text)
        if not isinstance(data, Mapping):
            raise TypeError(
                f"QuantizerConfig YAML must hold a mapping with keys such as 'weight' and 'activation', got "
                f"{type(data).__name__}: {data!r}"
            )
        return cls.from_dict(data)

    @public_api
    def to_yaml(self) -> str:
        """Return :meth:`to_dict` as YAML text (key order kept)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    @public_api
    def from_preset(cls, name: str) -> QuantizerConfig:
        """Build the preset called ``name`` with its default options (``"w8a8"``, ``"w4"``, ...).

        Raises:
            ValueError: Unknown preset; the message lists the valid names.
        """
        return cls.presets.get(name)()
