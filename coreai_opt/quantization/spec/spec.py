"""``QuantizationSpec``: the frozen, validated description of one quantizer.

A spec says *what* to quantize to (dtype, scheme, granularity) and *which parts* compute it (registry
keys of the range calculator, qparams calculator and fake-quantize module, plus their few numeric knobs).
Every part is built from the spec with ``cls.from_spec(spec)``.

Validation happens once, at construction, and every message names the offending field and the fix:

* ``dtype``: a name from :data:`~coreai_opt.quantization.spec.dtypes.SUPPORTED_DTYPES` or the matching
  torch dtype (normalised to the name). Float8 dtypes must use a symmetric scheme.
* registry keys must be registered *when the spec is built* (user-registered classes work); a registered
  class is accepted too and normalised to its key.
* a range calculator with ``accumulates = True`` (histograms) needs ``qparams_calculator="static"``;
  a stateless qparams calculator (``"dynamic"``) needs ``range_calculator="minmax"`` and no ``float_range``.
* ``float_range = (lo, hi)``: either end may be ``None`` (observed); ``lo ≤ 0 ≤ hi`` and ``lo < hi``.
* ``0 < averaging_constant ≤ 1``, ``50 < percentile ≤ 100``, ``num_bins`` a power of two ≥ 16.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_serializer, field_validator, model_validator

from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.spec.dtypes import QuantDtype, get_dtype_info
from coreai_opt.quantization.spec.granularity import (
    Granularity,
    PerBlock,
    PerTensor,
    PerToken,
    QuantizationScheme,
    granularity_from_dict,
)
from coreai_opt.quantization.spec.matmul_compute import (
    MATMUL_COMPUTE_BITS,
    block_size_problem,
    get_matmul_compute,
)
from coreai_opt.quantization.spec.num_bins import check_num_bins
from coreai_opt.quantization.spec.qparams_math import FLOAT32_MAX, quant_range
from coreai_opt.quantization.spec.registry import family

__all__ = ["QuantizationSpec"]

#: ``(low, high)`` of the fields that must satisfy ``low < value <= high``.
_HALF_OPEN_BOUNDS: dict[str, tuple[float, float]] = {"averaging_constant": (0.0, 1.0), "percentile": (50.0, 100.0)}


class QuantizationSpec(BaseModel):
    """How one tensor is quantized.

    Attributes:
        dtype: Quantized dtype name (``"int8"``, ``"uint4"``, ``"float8_e4m3fn"``, ...).
        qscheme: ``symmetric`` (default), ``symmetric_with_clipping`` or ``asymmetric``.
        granularity: :class:`PerTensor` (default), :class:`PerChannel`, :class:`PerBlock` or (stateless
            qparams only) :class:`PerToken`, or their dicts.
        range_calculator: Range calculator key (``"minmax"``, ``"percentile"``, ``"mse"``, ``"entropy"``).
        qparams_calculator: ``"static"``, ``"moving_average"``, ``"global_minmax"`` or ``"dynamic"``.
        float_range: Fixed ``(min, max)`` overriding the observed range; ``None`` ends are observed. In a config
            it describes the tensors the entry's ops produce (their outputs), not the inputs they read.
        averaging_constant: EMA weight ``c`` of ``moving_average``: ``m ← (1 − c)·m + c·batch``.
        percentile: Percentile kept by the ``"percentile"`` range calculator.
        num_bins: Histogram bins of the histogram range calculators.
        fake_quantize: Fake-quantize module key (``"default"``).
        weight_rounding: Weight-rounding algorithm key (``"rtn"``, ``"mse"``, ``"hqq"``, ``"gptq"``; see
            :mod:`~coreai_opt.quantization.rounding.weight_rounding`), or ``None``: round to nearest with the
            calculator's qparams. Integer dtypes of at most 8 bits, ``qparams_calculator="static"``.
        matmul_compute: How a weight-only linear with this weight computes in onnxruntime's ``MatMulNBits``: a
            :data:`~coreai_opt.quantization.spec.matmul_compute.MATMUL_COMPUTE` key, ``"float"`` (default,
            eager-equal) or ``"int8"`` (int8 activations per row and K block, emulated by the eager model; needs a
            4- or 8-bit integer weight, per-block with a block of 16 to 256 that is a power of two, or
            per-channel). Ignored for weights of other ops (convolutions, embeddings) and for linears whose
            input is quantized. Left out of :meth:`to_dict` when ``"float"``.

    Example:
        >>> s = QuantizationSpec(dtype=torch.int8, granularity={"type": "per_channel", "axis": 0})
        >>> s.dtype, s.quant_min, s.quant_max, s.granularity
        ('int8', -128, 127, PerChannel(axis=0))
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    dtype: str
    qscheme: QuantizationScheme = QuantizationScheme.SYMMETRIC
    granularity: Granularity = PerTensor()
    range_calculator: str = "minmax"
    qparams_calculator: str = "static"
    float_range: tuple[float | None, float | None] | None = None
    averaging_constant: float = 0.01
    percentile: float = 99.99
    num_bins: int = 2048
    fake_quantize: str = "default"
    weight_rounding: str | None = None
    matmul_compute: str = "float"

    # ----------------------------------------------------------------------------------- field validators
    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"unknown QuantizationSpec field(s) {unknown}; valid fields are: {', '.join(cls.model_fields)}"
                )
        return data

    @field_validator("dtype", mode="before")
    @classmethod
    def _normalise_dtype(cls, value: Any) -> str:
        if not isinstance(value, (str, torch.dtype)):
            raise TypeError(f"dtype must be a string such as 'int8' or a torch dtype, got {value!r}")
        return get_dtype_info(value).name

    @field_validator("granularity", mode="before")
    @classmethod
    def _build_granularity(cls, value: Any) -> Granularity:
        return granularity_from_dict(value)

    @field_validator("range_calculator", "qparams_calculator", "fake_quantize", "weight_rounding", mode="before")
    @classmethod
    def _check_registry_key(cls, value: Any, info: ValidationInfo) -> str | None:
        """A key of the field's registry, or a class of it (normalised to its key); ``weight_rounding`` may be None."""
        field = str(info.field_name)
        optional = field == "weight_rounding"
        if value is None and optional:
            return None
        registry = family(field)
        if isinstance(value, type):
            return registry.key_of(registry.resolve(value))
        if not isinstance(value, str):
            accepted = "a registry key (str), a registered class or None" if optional else \
                "a registry key (str) or a registered class"
            raise TypeError(f"{field} must be {accepted}, got {value!r}")
        registry.get_class(value)  # raises listing the known keys
        return value

    @field_validator("matmul_compute", mode="before")
    @classmethod
    def _check_matmul_compute(cls, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"matmul_compute must be a str ('float' or 'int8'), got {value!r}")
        return get_matmul_compute(value).name

    @field_validator("float_range")
    @classmethod
    def _check_float_range(
        cls, value: tuple[float | None, float | None] | None
    ) -> tuple[float | None, float | None] | None:
        if value is None or value == (None, None):
            return None
        lo, hi = value
        for end in (lo, hi):
            if end is not None and not math.isfinite(end):
                raise ValueError(f"float_range={value!r} must contain finite numbers or None")
            if end is not None and abs(end) > FLOAT32_MAX:
                raise ValueError(
                    f"float_range end {end!r} does not fit float32 (|end| <= {FLOAT32_MAX:.8g}); qparams are float32, "
                    "use a smaller range"
                )
        if lo is not None and lo > 0:
            raise ValueError(f"float_range min {lo} must be <= 0 (the range always contains 0)")
        if hi is not None and hi < 0:
            raise ValueError(f"float_range max {hi} must be >= 0 (the range always contains 0)")
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"float_range={value!r} needs min < max")
        return (lo, hi)

    @field_validator("averaging_constant", "percentile")
    @classmethod
    def _check_half_open_interval(cls, value: float, info: ValidationInfo) -> float:
        low, high = _HALF_OPEN_BOUNDS[info.field_name]
        if not low < value <= high:
            raise ValueError(f"{info.field_name}={value} must satisfy {low:g} < {info.field_name} <= {high:g}")
        return value

    @field_validator("num_bins")
    @classmethod
    def _check_num_bins(cls, value: int) -> int:
        return check_num_bins(value)

    # ------------------------------------------------------------------------------- cross-field checks
    @model_validator(mode="after")
    def _check_combination(self) -> QuantizationSpec:
        info = self.dtype_info
        if info.is_float and self.qscheme is QuantizationScheme.ASYMMETRIC:
            raise ValueError(
                f"qscheme='asymmetric' is invalid for dtype {self.dtype!r}: float8 has no zero point; "
                "use qscheme='symmetric'"
            )
        range_cls = family("range_calculator").get_class(self.range_calculator)
        qparams_cls = family("qparams_calculator").get_class(self.qparams_calculator)
        if getattr(range_cls, "accumulates", False) and self.qparams_calculator != "static":
            raise ValueError(
                f"range_calculator={self.range_calculator!r} accumulates every batch itself and needs "
                f"qparams_calculator='static', got qparams_calculator={self.qparams_calculator!r}"
            )
        if self.weight_rounding is not None and (info.is_float or info.bits > 8 or self.qparams_calculator != "static"):
            raise ValueError(
                f"weight_rounding={self.weight_rounding!r} needs an integer dtype of at most 8 bits and "
                f"qparams_calculator='static', got dtype={self.dtype!r}, qparams_calculator={self.qparams_calculator!r}"
            )
        if get_matmul_compute(self.matmul_compute).quantizes_activation:
            self._check_int8_compute(info)
        if isinstance(self.granularity, PerToken) and not getattr(qparams_cls, "stateless", False):
            raise ValueError(
                f"granularity=PerToken() gives one scale per row of each tensor, so its qparams must come from "
                f"every tensor: use qparams_calculator='dynamic', got qparams_calculator={self.qparams_calculator!r}"
            )
        if getattr(qparams_cls, "stateless", False):
            if self.range_calculator != "minmax":
                raise ValueError(
                    f"qparams_calculator={self.qparams_calculator!r} recomputes qparams from each tensor and "
                    f"needs range_calculator='minmax', got range_calculator={self.range_calculator!r}"
                )
            if self.float_range is not None:
                raise ValueError(
                    f"qparams_calculator={self.qparams_calculator!r} is stateless and cannot use float_range; "
                    "drop float_range or use qparams_calculator='static'"
                )
        return self

    def _check_int8_compute(self, info: QuantDtype) -> None:
        where = f"matmul_compute={self.matmul_compute!r}"
        if info.is_float or info.bits not in MATMUL_COMPUTE_BITS:
            raise ValueError(f"{where} runs onnxruntime's MatMulNBits, which stores 4- or 8-bit integer weights; "
                             f"got dtype={self.dtype!r}: use int4 / uint4 / int8 / uint8 or matmul_compute='float'")
        if isinstance(self.granularity, PerBlock):
            problem = block_size_problem(self.granularity.block_size, self.matmul_compute)
            if problem is not None:
                raise ValueError(f"{where}: {problem}; use a block size of 16, 32, 64, 128 or 256")

    # ------------------------------------------------------------------------------------ derived values
    @property
    def dtype_info(self) -> QuantDtype:
        """The dtype table row of :attr:`dtype`."""
        return get_dtype_info(self.dtype)

    @property
    def quant_min(self) -> int | float:
        """Lowest quantized value (narrowed to ``-quant_max`` for signed ``symmetric_with_clipping``)."""
        return quant_range(self.dtype_info, self.qscheme)[0]

    @property
    def quant_max(self) -> int | float:
        """Highest quantized value."""
        return quant_range(self.dtype_info, self.qscheme)[1]

    # ------------------------------------------------------------------------------------- serialisation
    @field_serializer("granularity")
    def _serialise_granularity(self, value: Granularity) -> dict[str, Any]:
        return value.to_dict()

    @public_api
    def to_dict(self) -> dict[str, Any]:
        """Return a plain, JSON-serialisable dict (granularity as its ``{"type": ...}`` dict)."""
        data = self.model_dump(mode="json")
        if data["matmul_compute"] == "float":  # the default: dicts (and saved states) from before the field
            del data["matmul_compute"]
        if data["float_range"] is not None:
            data["float_range"] = list(data["float_range"])
        return data

    @classmethod
    @public_api
    def from_dict(cls, data: dict[str, Any]) -> QuantizationSpec:
        """Build a spec from :meth:`to_dict` output (or any dict of fields)."""
        if not isinstance(data, dict):
            raise TypeError(f"QuantizationSpec.from_dict expects a dict, got {type(data).__name__}")
        return cls.model_validate(data)
