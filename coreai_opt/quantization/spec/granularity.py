"""Quantization schemes and granularities, with the tensor reshaping each granularity implies.

Qparam shapes follow ONNX QuantizeLinear conventions so that buffers fold straight into the exported graph:

==========================  =====================================================================
granularity                 scale / zero-point shape for a tensor of shape ``s``
==========================  =====================================================================
``PerTensor()``             ``()``
``PerChannel(axis)``        ``(s[axis],)``
``PerBlock(axis, B)``       ``s`` with ``s[axis]`` replaced by ``s[axis] // B`` (B must divide it)
``PerToken()``              ``s`` with the last dimension replaced by 1 (one row per token: ONNX
                            blocked along the last axis with ``block_size = s[-1]``)
``PerAxes(axes)``           ``s`` with every dimension not in ``axes`` replaced by 1 (one scale per index
                            combination of ``axes``, e.g. ``(1, 3)``: per key / value head and channel of a
                            ``(batch, heads, sequence, head_dim)`` KV cache; ONNX: the scale expanded to
                            ``x``'s shape, blocked with ``block_size = 1``)
==========================  =====================================================================

Every calculator works on the *rows view* of a tensor: a 2-D tensor ``(R, N)`` whose row ``r`` holds
the ``N`` elements that share qparam ``r`` (``R = prod(qparam_shape)``, row-major). Statistics reduce over
dim 1 and :meth:`Granularity.from_rows` reshapes a length-``R`` vector back to the qparam shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = [
    "QuantizationScheme",
    "Granularity",
    "PerTensor",
    "PerChannel",
    "PerBlock",
    "PerToken",
    "PerAxes",
    "granularity_from_dict",
]


class QuantizationScheme(str, Enum):
    """How the float range maps onto the integer range.

    * ``symmetric``: zero point at the middle of the range (0 for signed dtypes), full integer range,
      ``scale = max_abs / ((qmax - qmin) / 2)`` (int8: ``max_abs / 127.5`` over ``[-128, 127]``).
    * ``symmetric_with_clipping``: signed range narrowed to ``[-qmax, qmax]`` (int8: ``[-127, 127]``),
      ``scale = max_abs / qmax``.
    * ``asymmetric``: ``scale = (max - min) / (qmax - qmin)``, ``zp = clamp(qmin - round(min / scale))``.
    """

    SYMMETRIC = "symmetric"
    SYMMETRIC_WITH_CLIPPING = "symmetric_with_clipping"
    ASYMMETRIC = "asymmetric"


def _normalize_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise ValueError(
            f"{what} axis={axis} is out of range for a tensor of rank {rank}; "
            f"use an axis in [{-rank}, {rank - 1}]"
        )
    return axis % rank


class Granularity:
    """Base of the five granularities. Subclasses are frozen dataclasses (hashable, comparable)."""

    type_name: ClassVar[str]

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Return the scale / zero-point shape for a tensor of ``shape`` (ONNX convention)."""
        raise NotImplementedError

    def to_rows(self, x: Tensor) -> Tensor:
        """Return the ``(R, N)`` rows view: row ``r`` holds the elements sharing qparam ``r``."""
        raise NotImplementedError

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:
        """Broadcast a qparam tensor of :meth:`qparam_shape` against ``x``."""
        raise NotImplementedError

    def from_rows(self, values: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
        """Reshape a length-``R`` vector to the qparam shape of a tensor of ``shape``."""
        return values.reshape(self.qparam_shape(shape))

    def onnx_axis(self, rank: int) -> int:
        """Return the ``axis`` argument of the quantize-dequantize op (0 for per-tensor)."""
        return 0

    @property
    def block_size(self) -> int:
        """Block size (0 unless per-block)."""
        return 0

    def to_dict(self) -> dict[str, Any]:
        """Serialise to a plain dict with a ``"type"`` key."""
        raise NotImplementedError


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole tensor."""

    type_name: ClassVar[str] = "per_tensor"

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:  # noqa: D102
        return ()

    def to_rows(self, x: Tensor) -> Tensor:  # noqa: D102
        return x.reshape(1, -1)

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:  # noqa: D102
        return qparam

    def to_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"type": self.type_name}


@dataclass(frozen=True)
class PerChannel(Granularity):
    """One scale per index along ``axis`` (negative axes count from the end)."""

    axis: int = 0
    type_name: ClassVar[str] = "per_channel"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"PerChannel axis must be an int, got {self.axis!r}")

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:  # noqa: D102
        return (shape[_normalize_axis(self.axis, len(shape), "per-channel")],)

    def to_rows(self, x: Tensor) -> Tensor:  # noqa: D102
        axis = _normalize_axis(self.axis, x.dim(), "per-channel")
        return x.movedim(axis, 0).reshape(x.shape[axis], -1)

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:  # noqa: D102
        axis = _normalize_axis(self.axis, x.dim(), "per-channel")
        return qparam.reshape([-1 if i == axis else 1 for i in range(x.dim())])

    def onnx_axis(self, rank: int) -> int:  # noqa: D102
        return _normalize_axis(self.axis, rank, "per-channel")

    def to_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"type": self.type_name, "axis": self.axis}


@dataclass(frozen=True)
class PerBlock(Granularity):
    """One scale per contiguous block of ``block_size`` elements along ``axis`` (ONNX opset-21 blocking)."""

    axis: int = -1
    block_size: int = 32  # type: ignore[assignment]
    type_name: ClassVar[str] = "per_block"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"PerBlock axis must be an int, got {self.axis!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"PerBlock block_size must be a positive int, got {self.block_size!r}")

    def _checked_axis(self, shape: tuple[int, ...] | torch.Size) -> int:
        axis = _normalize_axis(self.axis, len(shape), "per-block")
        if shape[axis] % self.block_size:
            raise ValueError(
                f"per-block block_size={self.block_size} does not divide dimension {axis} of size {shape[axis]} "
                f"(tensor shape {tuple(shape)}); pick a block size that divides {shape[axis]}, e.g. "
                f"{math.gcd(shape[axis], self.block_size)}"
            )
        return axis

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:  # noqa: D102
        axis = self._checked_axis(shape)
        out = list(shape)
        out[axis] = shape[axis] // self.block_size
        return tuple(out)

    def to_rows(self, x: Tensor) -> Tensor:  # noqa: D102
        axis = self._checked_axis(x.shape)
        s = list(x.shape)
        blocked = x.reshape(s[:axis] + [s[axis] // self.block_size, self.block_size] + s[axis + 1 :])
        return blocked.movedim(axis + 1, -1).reshape(-1, self.block_size)

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:  # noqa: D102
        axis = self._checked_axis(x.shape)
        return qparam.repeat_interleave(self.block_size, dim=axis)

    def onnx_axis(self, rank: int) -> int:  # noqa: D102
        return _normalize_axis(self.axis, rank, "per-block")

    def to_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"type": self.type_name, "axis": self.axis, "block_size": self.block_size}


@dataclass(frozen=True)
class PerToken(Granularity):
    """One scale per row of the last axis: ``x[..., :]`` of every leading index (a token of ``(batch, seq, hidden)``).

    The qparam shape keeps the rank, ``s[:-1] + (1,)``, so a scale broadcasts against its rows and the ONNX form
    is a ``QuantizeLinear`` blocked along the last axis with ``block_size = s[-1]``. Only qparams computed from
    each tensor make sense per token (a dynamic activation spec): the number of rows follows the input.
    """

    type_name: ClassVar[str] = "per_token"

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:  # noqa: D102
        if len(shape) == 0:
            raise ValueError("per-token granularity needs a tensor of rank >= 1 (rows along the last axis), got a "
                             "scalar; use PerTensor() for scalars")
        return (*tuple(shape[:-1]), 1)

    def to_rows(self, x: Tensor) -> Tensor:  # noqa: D102
        self.qparam_shape(x.shape)
        return x.reshape(-1, x.shape[-1])

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:  # noqa: D102
        return qparam.reshape(self.qparam_shape(x.shape))

    def onnx_axis(self, rank: int) -> int:  # noqa: D102
        return _normalize_axis(-1, rank, "per-token")

    def to_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"type": self.type_name}


@dataclass(frozen=True)
class PerAxes(Granularity):
    """One scale per index combination of ``axes``; the qparam keeps the tensor's rank (1 on the other axes).

    ``PerAxes((1, 3))`` on a ``(batch, heads, sequence, head_dim)`` tensor has qparams of shape
    ``(1, heads, 1, head_dim)``: one scale per head and channel, shared by every batch row and position, which
    is onnxruntime's ``PER_CHANNEL`` KV-cache quantization (``GroupQueryAttention``'s ``k_scale`` / ``v_scale``).
    The rows view orders rows as the qparam does (row-major over ``axes``, ascending). Axes count from the end
    when negative and must be distinct; a tensor's rank must be fixed (the qparam has it).
    """

    axes: tuple[int, ...] = (1, 3)
    type_name: ClassVar[str] = "per_axes"

    def __post_init__(self) -> None:
        axes = tuple(self.axes) if isinstance(self.axes, (list, tuple)) else self.axes
        if (not isinstance(axes, tuple) or not axes
                or any(not isinstance(a, int) or isinstance(a, bool) for a in axes)):
            raise TypeError(f"PerAxes axes must be a non-empty tuple of ints, got {self.axes!r}")
        object.__setattr__(self, "axes", axes)

    def _axes(self, rank: int) -> tuple[int, ...]:
        axes = sorted(_normalize_axis(a, rank, "per-axes") for a in self.axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"PerAxes axes {self.axes} name the same axis twice for a tensor of rank {rank}")
        return tuple(axes)

    def qparam_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:  # noqa: D102
        axes = self._axes(len(shape))
        return tuple(int(n) if i in axes else 1 for i, n in enumerate(shape))

    def to_rows(self, x: Tensor) -> Tensor:  # noqa: D102
        axes = self._axes(x.dim())
        rows = math.prod(x.shape[a] for a in axes)
        return x.permute(*axes, *(i for i in range(x.dim()) if i not in axes)).reshape(rows, -1)

    def expand(self, qparam: Tensor, x: Tensor) -> Tensor:  # noqa: D102
        return qparam.reshape(self.qparam_shape(x.shape))

    def onnx_axis(self, rank: int) -> int:  # noqa: D102
        return self._axes(rank)[-1]

    def to_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"type": self.type_name, "axes": list(self.axes)}


_BY_NAME: dict[str, type[Granularity]] = {c.type_name: c for c in (PerTensor, PerChannel, PerBlock, PerToken,
                                                                   PerAxes)}


def granularity_from_dict(data: dict[str, Any] | Granularity) -> Granularity:
    """Build a granularity from ``{"type": "per_channel", "axis": 0}``-style dicts (granularities pass through).

    Raises:
        ValueError: unknown ``type`` or unexpected keys, naming them.
    """
    if isinstance(data, Granularity):
        return data
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(
            f"granularity must be a dict with a 'type' key (one of {sorted(_BY_NAME)}), got {data!r}"
        )
    kind = data["type"]
    if kind not in _BY_NAME:
        raise ValueError(f"unknown granularity type {kind!r}; valid types are: {', '.join(sorted(_BY_NAME))}")
    cls = _BY_NAME[kind]
    fields = {k: v for k, v in data.items() if k != "type"}
    allowed = {"per_tensor": set(), "per_channel": {"axis"}, "per_block": {"axis", "block_size"},
               "per_token": set(), "per_axes": {"axes"}}[kind]
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(
            f"granularity {kind!r} got unknown key(s) {sorted(unknown)}; allowed keys: {sorted(allowed) or 'none'}"
        )
    return cls(**fields)
