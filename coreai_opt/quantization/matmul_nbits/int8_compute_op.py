"""The eager twin of int8-compute ``MatMulNBits``: op ``coreai_opt::int8_compute_quantize`` and its module.

A weight-only linear whose weight spec says ``matmul_compute="int8"`` reads its input through
:class:`Int8ComputeActivation`, which fake-quantizes it exactly as onnxruntime's ``MatMulNBits`` at
``accuracy_level=4`` quantizes ``A``
(:func:`~coreai_opt.quantization.matmul_nbits.int8_compute.int8_compute_activation`:
per row, per block of ``block_size`` along ``K``, ``amax / 127``, round half to even). Gradient: straight-through.

In ONNX the op becomes a marker node ``coreai_opt.Int8ComputeActivation(x, block_size)`` (custom domain
:data:`INT8_COMPUTE_DOMAIN`), which no runtime executes: the export's ``MatMulNBits`` rule consumes it, writing the
linear as ``MatMulNBits(x, ..., accuracy_level=4)`` whose kernel does the quantization itself. A marker the rule
could not consume makes ``export_onnx`` fail naming the node, so an int8-compute model never exports as float.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import onnx.defs
import torch
from torch import Tensor, nn

from coreai_opt.quantization.matmul_nbits.int8_compute import int8_compute_activation

__all__ = ["INT8_COMPUTE_DOMAIN", "INT8_COMPUTE_MARKER", "Int8ComputeActivation", "int8_compute_quantize",
           "int8_compute_translation_table"]

#: Custom ONNX domain of the marker node (never left in a saved file).
INT8_COMPUTE_DOMAIN = "coreai_opt"
#: Op type of the marker node.
INT8_COMPUTE_MARKER = "Int8ComputeActivation"


@torch.library.custom_op("coreai_opt::int8_compute_quantize", mutates_args=())
def int8_compute_quantize(x: Tensor, block_size: int) -> Tensor:
    """``int8_compute_activation(x, block_size)`` (float32 ``x``) as a custom op, so the exporter can mark it."""
    return int8_compute_activation(x, block_size)


@int8_compute_quantize.register_fake
def _int8_compute_quantize_fake(x: Tensor, block_size: int) -> Tensor:
    del block_size
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    del ctx, inputs, output


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    del ctx
    return grad, None


int8_compute_quantize.register_autograd(_backward, setup_context=_setup_context)


class Int8ComputeActivation(nn.Module):
    """Fake-quantize a linear's input as int8-compute ``MatMulNBits`` does (module docstring).

    Args:
        block_size: The ``MatMulNBits`` block size of the linear's weight
            (:func:`~coreai_opt.quantization.spec.matmul_compute.matmul_nbits_block_size`).
    """

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = int(block_size)
        self.name = type(self).__name__

    def set_name(self, name: str) -> None:
        """Name shown in errors (the linear it serves)."""
        self.name = name

    def extra_repr(self) -> str:
        """``block_size=…`` in the module's repr."""
        return f"block_size={self.block_size}"

    def forward(self, x: Tensor) -> Tensor:
        """``x`` with int8-compute activation quantization (computed in float32, returned in ``x``'s dtype)."""
        y = int8_compute_quantize(x if x.dtype == torch.float32 else x.float(), self.block_size)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def _marker_schema() -> onnx.defs.OpSchema:
    schema = onnx.defs.OpSchema
    return schema(INT8_COMPUTE_MARKER, INT8_COMPUTE_DOMAIN, 1,
                  inputs=[schema.FormalParameter("X", "T")], outputs=[schema.FormalParameter("Y", "T")],
                  type_constraints=[("T", ["tensor(float)"], "float32 activation")],
                  attributes=[schema.Attribute("block_size", schema.AttrType.INT, "MatMulNBits block size")])


def int8_compute_translation_table() -> dict[Any, Callable[..., Any]]:
    """``{torch.ops.coreai_opt.int8_compute_quantize.default: translation}`` emitting the marker node."""
    values = importlib.import_module("onnxscript.values")
    marker = values.Op(values.Opset(INT8_COMPUTE_DOMAIN, 1), INT8_COMPUTE_MARKER, _marker_schema())

    def int8_compute_quantize_onnx(x: Any, block_size: int) -> Any:
        return marker(x, block_size=block_size)

    return {torch.ops.coreai_opt.int8_compute_quantize.default: int8_compute_quantize_onnx}
