"""Ready-made :class:`QuantizerConfig` presets, reachable as ``QuantizerConfig.presets.<name>()``.

* ``w8``: int8 symmetric per-channel (axis 0) weights on the narrowed grid ``[-127, 127]`` (``symmetric_with_clipping``,
  minmax / static; every integer weight preset uses it, see :func:`_per_channel_weight`); float activations.
* ``w4(block_size=32, algorithm="gptq", qscheme="asymmetric")``: int4 per-block (axis 1) weights rounded by GPTQ
  (needs ``calibrate``; ``algorithm="rtn"`` / ``"hqq"`` / ``"mse"`` are data-free); float activations.
* ``w8a8``: int8 per-channel weights + uint8 asymmetric per-tensor activations (minmax / global_minmax).
* ``w8a8_sym``: int8 per-channel weights + int8 symmetric per-tensor activations.
* ``w4a8``: int4 per-block (axis 1, 32) weights as ``w4`` + uint8 asymmetric per-tensor activations.
* ``w8a16``: int8 per-channel weights + uint16 asymmetric per-tensor activations.
* ``fp8``: float8_e4m3fn symmetric weights (per-channel, axis 0) and activations (per-tensor).
* ``w8a8_dynamic``: linears only: int8 per-channel weights + uint8 per-tensor activations whose qparams are
  computed from every tensor at run time (ONNX ``DynamicQuantizeLinear``); no calibration data needed. Not in
  ``names()`` (the calibrated presets every model takes, which the zoo sweeps) but in ``all_names()`` (every preset
  ``get`` and the CLI's ``--preset`` accept).

``describe()`` returns this list as (name, weight summary, activation summary) rows built from the presets;
``int8_kv_cache()`` is a spec (``QuantizerConfig.kv_cache``: a decoder's KV cache), not a config.

Choices:

* ``w8a8`` (uint8 activations, int8 per-channel weights) is the onnxruntime x86 fast path: it fuses into
  QLinearConv / QLinearMatMul / QGemm. ``w8a8_sym`` (int8 activations) leaves most convs in float there.
* Per-block weights block along axis 1, the input channels of Linear ``[out, in]`` and Conv
  ``[out, in, kh, kw]`` weights (the graph pass adjusts it for transposed convs).
* ``w8a16`` uses **uint16 asymmetric** activations: onnxruntime has no fused 16-bit kernels, so neither int16
  nor uint16 is a speed preset; it is an accuracy preset. Asymmetric uint16 spends no code on the empty half
  of one-sided (post-ReLU, softmax) ranges, and matches onnxruntime's own 16-bit activation convention
  (``QuantType.QUInt16``). It needs ONNX opset 21.
* ``int32_bias`` is turned off where no per-output-channel weight scale exists (per-block weights) or where
  integer accumulation does not apply (fp8); biases then stay float.
* ``activation_range`` (:data:`ACTIVATION_RANGES`: range calculator -> qparams calculator): ``"minmax"`` ->
  ``"global_minmax"``, ``"moving_average"`` -> ``"moving_average"``, ``"percentile"`` / ``"mse"`` / ``"entropy"``
  -> ``"static"`` (the histogram already summarises every batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from coreai_opt.config.kv_cache_spec import int8_kv_cache
from coreai_opt.config.op_config import OpConfig
from coreai_opt.config.quantizer_config import QuantizerConfig
from coreai_opt.error_boundary import public_api
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import dynamic_activation_spec
from coreai_opt.quantization.spec import PerBlock, PerChannel, PerTensor, PerToken, QuantizationScheme, QuantizationSpec
from coreai_opt.quantization.spec.dtypes import get_dtype_info

__all__ = [
    "ACTIVATION_RANGES",
    "PresetInfo",
    "Presets",
    "all_names",
    "describe",
    "fp8",
    "get",
    "names",
    "w4",
    "w4a8",
    "w8",
    "w8a8",
    "w8a8_sym",
    "w8a16",
    "w8a8_dynamic",
]

#: ``activation_range`` choice -> (range calculator, qparams calculator).
ACTIVATION_RANGES: dict[str, tuple[str, str]] = {
    "minmax": ("minmax", "global_minmax"),
    "moving_average": ("minmax", "moving_average"),
    "percentile": ("percentile", "static"),
    "mse": ("mse", "static"),
    "entropy": ("entropy", "static"),
}


#: Default weight rounding of ``w4`` / ``w4a8``: the best on MiniLM (docs/weight_rounding.md).
W4_ALGORITHM: str | None = "gptq"
#: Default weight scheme of ``w4`` / ``w4a8``: asymmetric (integer zero point per block) measured above symmetric
#: with GPTQ on MiniLM at block 32 (mean cos 0.9906 vs 0.9889; docs/weight_rounding.md).
W4_QSCHEME: str = "asymmetric"


class PresetInfo(NamedTuple):
    """One row of :func:`describe`.

    Attributes:
        name: Preset name.
        weight: Human-readable weight spec summary, or ``"float"``.
        activation: Human-readable activation spec summary, or ``"float"``.
    """

    name: str
    weight: str
    activation: str


def _per_channel_weight(dtype: str, compute: str = "float") -> QuantizationSpec:
    """Per-output-channel weights; integer ones on the narrowed grid ``[-127, 127]``, ``scale = max|W_r| / 127``.

    The narrowed grid puts each row's largest weight exactly on a level, where the full grid
    (``scale = max|W_r| / 127.5``) rounds it by half a step. On the short rows of real CNNs (fan-in 4-16:
    bottleneck 1x1 convolutions) that one element dominates the row's error: measured on the corpus, per-row MSE
    is 1.1-1.6x ``s²/12`` on the full grid and 0.88-0.97x on the narrowed one, and the model's SQNR goes from
    36.1 to 38.1 dB (transformers ResNet), 35.1 to 36.4 dB (RegNet), 28.7 to 30.0 dB (timm ResNet-18). It is also
    onnxruntime's own choice for int8 weights, so files compare like with like.
    """
    dtype_info = get_dtype_info(dtype)
    integer = not dtype_info.is_float
    return QuantizationSpec(
        dtype=dtype,
        qscheme=QuantizationScheme.SYMMETRIC_WITH_CLIPPING if integer else QuantizationScheme.SYMMETRIC,
        granularity=PerChannel(axis=0),
        range_calculator="minmax",
        qparams_calculator="static",
        matmul_compute=compute,
    )


def _per_block_weight(
    dtype: str, block_size: int, algorithm: str | None = None, qscheme: str = "symmetric", compute: str = "float"
) -> QuantizationSpec:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (e.g. 32), got {block_size!r}")
    if qscheme not in ("symmetric", "asymmetric"):
        raise ValueError(f"qscheme must be 'symmetric' or 'asymmetric', got {qscheme!r}")
    return QuantizationSpec(
        dtype=dtype,
        qscheme=qscheme,
        granularity=PerBlock(axis=1, block_size=block_size),
        range_calculator="minmax",
        qparams_calculator="static",
        weight_rounding=algorithm,
        matmul_compute=compute,
    )


def _activation(
    dtype: str, qscheme: QuantizationScheme, activation_range: str, percentile: float | None
) -> QuantizationSpec:
    if activation_range not in ACTIVATION_RANGES:
        raise ValueError(
            f"unknown activation_range {activation_range!r}; valid choices: {', '.join(ACTIVATION_RANGES)}"
        )
    range_calculator, qparams_calculator = ACTIVATION_RANGES[activation_range]
    if percentile is not None and activation_range != "percentile":
        raise ValueError(
            f"percentile={percentile!r} only applies to activation_range='percentile', "
            f"not {activation_range!r}; drop percentile or set activation_range='percentile'"
        )
    options = {} if percentile is None else {"percentile": percentile}
    return QuantizationSpec(
        dtype=dtype,
        qscheme=qscheme,
        granularity=PerTensor(),
        range_calculator=range_calculator,
        qparams_calculator=qparams_calculator,
        **options,
    )


@dataclass(frozen=True)
class _Row:
    """One preset of the table.

    ``weight`` dtype per channel (axis 0) or ``per_block`` (axis 1: block size / rounding / qscheme options, per-channel
    fallback); ``activation``: ``(dtype, qscheme)`` per tensor, or None (float); ``int32_bias`` (off: fp8, per-block).
    """

    weight: str
    activation: tuple[str, QuantizationScheme] | None
    per_block: bool = False
    int32_bias: bool = True


#: The calibrated presets, in ``names()`` order (``w8a8_dynamic`` is built apart: a per-op-kind config).
_TABLE: dict[str, _Row] = {
    "w8": _Row("int8", None),
    "w4": _Row("int4", None, per_block=True, int32_bias=False),
    "w8a8": _Row("int8", ("uint8", QuantizationScheme.ASYMMETRIC)),
    "w8a8_sym": _Row("int8", ("int8", QuantizationScheme.SYMMETRIC)),
    "w4a8": _Row("int4", ("uint8", QuantizationScheme.ASYMMETRIC), per_block=True, int32_bias=False),
    "w8a16": _Row("int8", ("uint16", QuantizationScheme.ASYMMETRIC)),
    "fp8": _Row("float8_e4m3fn", ("float8_e4m3fn", QuantizationScheme.SYMMETRIC), int32_bias=False),
}


def _build(name: str, *, block_size: int = 32, algorithm: str | None = W4_ALGORITHM, qscheme: str = W4_QSCHEME,
           compute: str = "float", activation_range: str = "minmax", percentile: float | None = None
           ) -> QuantizerConfig:
    """The config of table row ``name`` with the options its factory takes (the others keep these defaults)."""
    row = _TABLE[name]
    weight = (_per_block_weight(row.weight, block_size, algorithm, qscheme, compute) if row.per_block
              else _per_channel_weight(row.weight, compute))
    activation = None if row.activation is None else _activation(*row.activation, activation_range, percentile)
    options: dict[str, object] = {} if row.int32_bias else {"int32_bias": False}  # only what differs from defaults
    if row.per_block:
        options["per_block_fallback"] = "per_channel"
    return QuantizerConfig(weight=weight, activation=activation, **options)


@public_api
def w8(compute: str = "float") -> QuantizerConfig:
    """Int8 symmetric per-channel (axis 0) weights, minmax range, static qparams; activations float.

    Args:
        compute: How the linears run in onnxruntime (``MatMulNBits``): ``"float"`` (exact float compute, eager-equal)
            or ``"int8"`` (int8 activations per row and K block: faster; the eager model emulates it). See
            :mod:`coreai_opt.quantization.spec.matmul_compute`.
    """
    return _build("w8", compute=compute)


@public_api
def w4(block_size: int = 32, algorithm: str | None = W4_ALGORITHM, qscheme: str = W4_QSCHEME,
       compute: str = "float") -> QuantizerConfig:
    """Int4 per-block weights (axis 1, ``block_size``) rounded by ``algorithm``, activations float.

    Args:
        block_size: Elements per block along the input channels. Layers whose input-channel count it does
            not divide (e.g. a 3-channel stem conv) fall back to per-channel int4 with a warning.
        algorithm: A ``weight_rounding`` key (``"rtn"``, ``"mse"``, ``"hqq"``, ``"gptq"`` or a registered one)
            or None for the plain min/max quantizer. ``"gptq"`` needs ``calibrate`` before ``convert``.
        qscheme: ``"symmetric"`` or ``"asymmetric"`` (integer zero point per block).
        compute: ``"float"`` or ``"int8"``, as for :func:`w8` (``"int8"`` needs a block size of 16 to 256).
    """
    return _build("w4", block_size=block_size, algorithm=algorithm, qscheme=qscheme, compute=compute)


@public_api
def w8a8(activation_range: str = "minmax", percentile: float | None = None) -> QuantizerConfig:
    """Int8 per-channel weights + uint8 asymmetric per-tensor activations: the onnxruntime x86 fast path.

    Args:
        activation_range: One of :data:`ACTIVATION_RANGES` (default ``"minmax"``: global min/max).
        percentile: Percentile for ``activation_range="percentile"`` (spec default when None).
    """
    return _build("w8a8", activation_range=activation_range, percentile=percentile)


@public_api
def w8a8_sym(activation_range: str = "minmax", percentile: float | None = None) -> QuantizerConfig:
    """Int8 per-channel weights + int8 symmetric per-tensor activations.

    ``activation_range`` and ``percentile`` as for :func:`w8a8`.
    """
    return _build("w8a8_sym", activation_range=activation_range, percentile=percentile)


@public_api
def w4a8(
    block_size: int = 32,
    activation_range: str = "minmax",
    percentile: float | None = None,
    algorithm: str | None = W4_ALGORITHM,
    qscheme: str = W4_QSCHEME,
) -> QuantizerConfig:
    """Int4 per-block weights (as :func:`w4`) + uint8 asymmetric per-tensor activations; biases stay float.

    Args:
        block_size: Elements per weight block along the input channels.
        algorithm: Weight rounding, as for :func:`w4`.
        qscheme: Weight scheme, as for :func:`w4`.
        activation_range: One of :data:`ACTIVATION_RANGES`.
        percentile: Percentile for ``activation_range="percentile"``.
    """
    return _build("w4a8", block_size=block_size, algorithm=algorithm, qscheme=qscheme,
                  activation_range=activation_range, percentile=percentile)


@public_api
def w8a16(activation_range: str = "minmax", percentile: float | None = None,
          compute: str = "float") -> QuantizerConfig:
    """Int8 per-channel weights + uint16 asymmetric per-tensor activations (accuracy preset; opset 21).

    Args:
        activation_range: One of :data:`ACTIVATION_RANGES`.
        percentile: Percentile for ``activation_range="percentile"``.
        compute: ``"float"`` or ``"int8"``, as for :func:`w8`: the linears (16-bit input, 8-bit weight) run as
            ``MatMulNBits``.
    """
    return _build("w8a16", compute=compute, activation_range=activation_range, percentile=percentile)


@public_api
def fp8(activation_range: str = "minmax", percentile: float | None = None) -> QuantizerConfig:
    """float8_e4m3fn symmetric weights (per-channel, axis 0) and activations (per-tensor); biases stay float.

    ``activation_range`` and ``percentile`` as for :func:`w8a8`.
    """
    return _build("fp8", activation_range=activation_range, percentile=percentile)


@public_api
def w8a8_dynamic(per_token: bool = False) -> QuantizerConfig:
    """Dynamic W8A8 for transformers: every linear gets int8 per-channel weights and a dynamic uint8 input.

    The input quantizer (fake-quantize key ``"dynamic"``) computes ``s = (max(0, max x) − min(0, min x)) / 255``
    and its zero point from each tensor (ONNX ``DynamicQuantizeLinear``; nothing to calibrate), run as onnxruntime
    ``DynamicQuantizeMatMul``. Everything else stays float. Smooth outliers first with ``smooth_quant``.

    Args:
        per_token: One ``(s, z)`` per row of the last axis (``PerToken()``): a token's codes do not depend on the
            call's other tokens, so a KV-cache step and a full regeneration agree (``--task text-generation``);
            ONNX ops (opset 21) + ``MatMulInteger``, ~2x the fused per-tensor kernel's time (256 x 256 linear).
    """
    activation = dynamic_activation_spec(PerToken() if per_token else PerTensor())
    return QuantizerConfig(weight=None, activation=None).set_op_kind(
        "linear", OpConfig(weight=_per_channel_weight("int8"), activation=activation))


_PRESETS: dict[str, Callable[..., QuantizerConfig]] = {
    "w8": w8,
    "w4": w4,
    "w8a8": w8a8,
    "w8a8_sym": w8a8_sym,
    "w4a8": w4a8,
    "w8a16": w8a16,
    "fp8": fp8,
}

#: Presets outside ``names()``: per-op-kind configs that need no calibration (transformer linears only).
_DYNAMIC_PRESETS: dict[str, Callable[..., QuantizerConfig]] = {"w8a8_dynamic": w8a8_dynamic}


@public_api
def names() -> tuple[str, ...]:
    """Return the calibrated preset names in table order (the set every model takes; no ``w8a8_dynamic``)."""
    return tuple(_PRESETS)


@public_api
def all_names() -> tuple[str, ...]:
    """Return every preset name :func:`get` accepts: ``names()`` then the dynamic presets (``w8a8_dynamic``)."""
    return (*_PRESETS, *_DYNAMIC_PRESETS)


@public_api
def get(name: str) -> Callable[..., QuantizerConfig]:
    """Return the preset factory called ``name`` (call it, with options, to build the config).

    Raises:
        ValueError: Unknown name; the message lists the valid names.
    """
    factories = {**_PRESETS, **_DYNAMIC_PRESETS}
    if name not in factories:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(factories)}")
    return factories[name]


def _granularity_summary(spec: QuantizationSpec) -> str:
    g = spec.granularity
    if isinstance(g, PerBlock):
        return f"per-block(axis={g.axis}, block_size={g.block_size})"
    if isinstance(g, PerChannel):
        return f"per-channel(axis={g.axis})"
    return "per-tensor"


def summarize_spec(spec: QuantizationSpec | None) -> str:
    """One-line summary of a spec, e.g. ``"uint8 asymmetric per-tensor, minmax/global_minmax"``; None -> float."""
    if spec is None:
        return "float"
    qscheme = QuantizationScheme(spec.qscheme).value
    text = f"{spec.dtype} {qscheme} {_granularity_summary(spec)}, {spec.range_calculator}/{spec.qparams_calculator}"
    text = f"{text}, {spec.weight_rounding} rounding" if spec.weight_rounding else text
    return f"{text}, {spec.matmul_compute} compute" if spec.matmul_compute != "float" else text


@public_api
def describe() -> list[PresetInfo]:
    """Return one :class:`PresetInfo` per preset (default options), computed from the built configs."""
    rows = []
    for name, factory in _PRESETS.items():
        config = factory()
        rows.append(PresetInfo(name, summarize_spec(config.weight), summarize_spec(config.activation)))
    return rows


class Presets:
    """The ``QuantizerConfig.presets`` namespace: the preset factories plus ``names``, ``get``, ``describe``."""

    w8 = staticmethod(w8)
    w4 = staticmethod(w4)
    w8a8 = staticmethod(w8a8)
    w8a8_sym = staticmethod(w8a8_sym)
    w4a8 = staticmethod(w4a8)
    w8a16 = staticmethod(w8a16)
    fp8 = staticmethod(fp8)
    w8a8_dynamic = staticmethod(w8a8_dynamic)
    int8_kv_cache = staticmethod(int8_kv_cache)
    names = staticmethod(names)
    all_names = staticmethod(all_names)
    get = staticmethod(get)
    describe = staticmethod(describe)


QuantizerConfig.presets = Presets
