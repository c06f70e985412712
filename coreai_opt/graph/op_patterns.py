"""What each op kind quantizes: the pattern table :func:`coreai_opt.passes.annotate.annotate` applies.

One :class:`OpPattern` per :class:`~coreai_opt.graph.op_kinds.OpKind` (the placement table and its reasons are in
:mod:`coreai_opt.passes.annotate`'s docstring). The config's ``op_kind`` keys derive from it
(:data:`CONFIGURABLE_KINDS`), so the two cannot drift apart. Weight granularity axes are written for the canonical
``[out, in, *kernel]`` layout; :func:`weight_axes_of` and :func:`map_weight_spec` move them to an op's real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreai_opt.graph.op_kinds import MOVER_KINDS, ArgLayout, OpKind
from coreai_opt.quantization.spec import PerBlock, PerChannel, QuantizationSpec

__all__ = ["CANONICAL_AXES", "CLAMP_KINDS", "CONFIGURABLE_KINDS", "MATMUL_AXES", "PATTERNS", "SHARING_KINDS",
           "OpPattern", "map_weight_spec", "weight_axes_of"]

#: The clamps (relu, relu6, hardtanh): onnxruntime folds them into the ``QuantizeLinear`` after them.
CLAMP_KINDS = frozenset({OpKind.RELU, OpKind.RELU6, OpKind.HARDTANH})


@dataclass(frozen=True)
class OpPattern:
    """What one op kind quantizes (the table in annotate's docstring)."""

    inputs: bool = True
    weight_axes: dict[int, int] | None = None  # canonical axis -> real axis; None: no weight
    output: str | None = "own"  # "own", "share" (value-preserving) or None
    fuse_activation: bool = False
    float_range: tuple[float, float] | None = None
    power_of_two_step: bool = False  # shrink the fixed range so an integer step is 2^-k (see activation_ranges)

    @property
    def reads_config(self) -> bool:
        """False for value-moving ops, which share their input's quantizer whatever the config says."""
        return self.output != "share"


#: The canonical weight layout ``[out, in, *kernel]``: canonical axis -> real axis.
CANONICAL_AXES = {0: 0, 1: 1}
PATTERNS: dict[OpKind, OpPattern] = {
    OpKind.CONV: OpPattern(weight_axes=CANONICAL_AXES, fuse_activation=True),
    OpKind.CONV_TRANSPOSE: OpPattern(weight_axes={0: 1, 1: 0}, fuse_activation=True),
    OpKind.LINEAR: OpPattern(weight_axes=CANONICAL_AXES, fuse_activation=True),
    OpKind.EMBEDDING: OpPattern(inputs=False, weight_axes=CANONICAL_AXES, output=None),
    OpKind.MATMUL: OpPattern(fuse_activation=True),
    **{k: OpPattern(fuse_activation=True) for k in (OpKind.ADD, OpKind.MUL, OpKind.SUB, OpKind.DIV)},
    **{k: OpPattern() for k in (OpKind.LAYER_NORM, OpKind.GROUP_NORM, OpKind.GELU, OpKind.SILU, OpKind.HARDSWISH,
                               OpKind.INTERPOLATE, OpKind.AVG_POOL, OpKind.SIGMOID,
                               OpKind.TANH)},  # sigmoid / tanh: calibrated (annotate's docstring)
    **{k: OpPattern(inputs=False) for k in CLAMP_KINDS},  # the clamps: output only (annotate's docstring)
    OpKind.SOFTMAX: OpPattern(float_range=(0.0, 1.0), power_of_two_step=True),
    OpKind.CAT: OpPattern(),  # inputs keep their producers' ranges (annotate's docstring: why not one shared)
    **{k: OpPattern(inputs=False, output="share") for k in MOVER_KINDS},
}
#: Op kinds whose pattern applies the config's specs, in :class:`OpKind` order: the config's ``op_kind`` keys.
CONFIGURABLE_KINDS: tuple[OpKind, ...] = tuple(k for k in OpKind if k in PATTERNS and PATTERNS[k].reads_config)
#: Op kinds that only move values and share their input's quantizer (a config cannot target them).
SHARING_KINDS: tuple[OpKind, ...] = tuple(k for k in OpKind if k in PATTERNS and not PATTERNS[k].reads_config)
#: Operand index of a matmul -> canonical-to-real axis map of a constant operand ([M, K] @ [K, N]).
MATMUL_AXES = {0: {0: -2, 1: -1}, 1: {0: -1, 1: -2}}


def weight_axes_of(pattern: OpPattern, layout: ArgLayout) -> dict[int, int] | None:
    """Canonical -> real weight axes: the call's own layout (``addmm``'s ``[in, out]``) or the kind's."""
    return dict(layout.weight_axes) if layout.weight_axes else pattern.weight_axes


def map_weight_spec(spec: QuantizationSpec, axes: dict[int, int], shape: tuple[int, ...]) -> QuantizationSpec:
    """Return ``spec`` with its granularity axis moved from the canonical layout to the weight's layout."""
    g = spec.granularity
    if not isinstance(g, (PerChannel, PerBlock)):
        return spec
    canonical = g.axis % len(shape) if -len(shape) <= g.axis < len(shape) else g.axis
    real = axes.get(canonical, canonical)
    real = real % len(shape) if -len(shape) <= real < len(shape) else real
    mapped = PerChannel(real) if isinstance(g, PerChannel) else PerBlock(real, g.block_size)
    return spec.model_copy(update={"granularity": mapped})
