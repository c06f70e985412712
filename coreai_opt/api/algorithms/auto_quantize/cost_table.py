r"""Per-kernel latency model: ``t(kind, MACs) = overhead + MACs / throughput``, one line per kernel kind.

A kernel kind is how onnxruntime runs one linear or convolution under one candidate format:

=======================  ===============================================================================
kind                     onnxruntime kernel (CPU execution provider)
=======================  ===============================================================================
``linear_float``         ``Gemm`` / ``MatMul`` in float32
``linear_dynamic``       ``DynamicQuantizeMatMul`` (``DynamicQuantizeLinear`` + ``MatMulInteger``, per-tensor
                         uint8)
``linear_int8_compute``  ``MatMulNBits`` (``bits=8``, ``accuracy_level=4``: int8 activation per row and K
                         block, int8 weight per block, int32 accumulation) + ``Add`` of the bias
``linear_static``        ``QuantizeLinear`` + ``QGemm`` (uint8 input, int8 weight, requantized uint8 output)
``linear_int16``         uint16 ``Q → DQ`` around a float ``Gemm`` (no 16-bit integer kernel exists)
``conv_float``           ``Conv`` in float32
``conv_static``          ``QLinearConv`` (uint8 input and output, int8 weight)
``conv_int16``           uint16 ``Q → DQ`` around a float ``Conv``
=======================  ===============================================================================

A :class:`CostTable` holds one :class:`KernelCost` per kind and a ``key`` naming the machine it was measured on
(CPU model, onnxruntime version, thread count). Tables are plain data: tests inject hand-written ones, and
:mod:`coreai_opt.api.algorithms.auto_quantize.cost_measurement` measures and caches the real one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coreai_opt.error_boundary import public_api

__all__ = ["KERNEL_KINDS", "CostTable", "KernelCost"]

#: Every kernel kind a table must price (module docstring).
KERNEL_KINDS: tuple[str, ...] = ("linear_float", "linear_dynamic", "linear_int8_compute", "linear_static",
                                 "linear_int16", "conv_float", "conv_static", "conv_int16")


@dataclass(frozen=True)
class KernelCost:
    """Latency line of one kernel kind.

    Attributes:
        overhead_us: Fixed cost per call in microseconds (quantize / dequantize steps, dispatch).
        macs_per_us: Multiply-accumulates per microsecond (throughput), > 0.
    """

    overhead_us: float
    macs_per_us: float

    def __post_init__(self) -> None:
        if not (self.overhead_us >= 0.0 and self.macs_per_us > 0.0):
            raise ValueError(f"KernelCost needs overhead_us >= 0 and macs_per_us > 0, got {self}")

    @public_api
    def latency_us(self, macs: float) -> float:
        """``overhead_us + macs / macs_per_us``."""
        return self.overhead_us + float(macs) / self.macs_per_us


@dataclass(frozen=True)
class CostTable:
    """One :class:`KernelCost` per kernel kind, measured on the machine named by ``key``.

    Example:
        >>> line = KernelCost(overhead_us=5.0, macs_per_us=1000.0)
        >>> table = CostTable({k: line for k in KERNEL_KINDS}, key="test")
        >>> table.latency_us("linear_static", 10_000)
        15.0
    """

    kernels: Mapping[str, KernelCost]
    key: str

    def __post_init__(self) -> None:
        missing = [k for k in KERNEL_KINDS if k not in self.kernels]
        unknown = [k for k in self.kernels if k not in KERNEL_KINDS]
        if missing or unknown:
            raise ValueError(f"CostTable {self.key!r}: missing kernel kinds {missing}, unknown kinds {unknown}; "
                             f"a table prices exactly {list(KERNEL_KINDS)}")

    @public_api
    def latency_us(self, kind: str, macs: float) -> float:
        """Estimated latency in microseconds of one ``kind`` call doing ``macs`` multiply-accumulates."""
        return self.kernels[kind].latency_us(macs)

    @public_api
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; :meth:`from_dict` rebuilds an equal table."""
        return {"key": self.key, "kernels": {k: {"overhead_us": c.overhead_us, "macs_per_us": c.macs_per_us}
                                             for k, c in self.kernels.items()}}

    @classmethod
    @public_api
    def from_dict(cls, data: Mapping[str, Any]) -> CostTable:
        """Build from :meth:`to_dict` output.

        Raises:
            ValueError: a kind is missing or unknown, or a line is not positive.
            KeyError: ``key`` or ``kernels`` is absent.
        """
        kernels = {k: KernelCost(float(v["overhead_us"]), float(v["macs_per_us"])) for k, v in data["kernels"].items()}
        return cls(kernels, str(data["key"]))
