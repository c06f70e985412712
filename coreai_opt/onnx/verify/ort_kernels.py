"""What each onnxruntime CPU kernel does to our numbers: the table ``verify_onnx`` and the rewrite audit read.

onnxruntime rewrites the exported QDQ graph (``DQ → Conv → Q`` becomes ``QLinearConv``, ``DQ → MatMul`` becomes
``MatMulNBits``, ...). Every op type that can appear in its optimized graph is listed here with one status:

* ``exact``: given the same inputs it returns the same bits as the eager torch op it replaces (data movement,
  max-pooling, the quantize / dequantize ops, and IEEE-754 correctly rounded elementwise arithmetic ``+ − × ÷``,
  ``max``, ``min``, ``sqrt``). It adds no difference.
* ``emulated``: onnxruntime computes it differently from plain float math and the eager model reproduces that
  computation (``DynamicQuantizeLinear`` through ``coreai_opt::dynamic_quantize_dequantize``; ``QLinearSoftmax``'s
  ``floor(1 / y_scale)`` through power-of-two softmax output steps). What is left is one rounding.
* ``pinned``: it differs from eager by a bounded amount whose cause is known and pinned by a test: float
  accumulation order (convolutions, matrix products, reductions, normalizations, transcendental functions) or an
  integer kernel's own requantisation rounding (``round(acc · M)`` with ``M = s_x·s_w / s_y`` instead of eager's
  ``round(float_result / s_y)``). The difference is a few float ulps, which moves a value across a rounding
  boundary of the next quantizer at most once: one quantization step there.
* ``diverges``: it computes something the eager model does not reproduce (``MatMulNBits`` at
  ``accuracy_level=4`` quantizes the activation to int8 on the fly). The audit fails on it.

:func:`kernel_numerics` looks a node up (an attribute can change the status: ``MatMulNBits``' accuracy level);
an op type missing from the table is reported as unknown, so an onnxruntime upgrade that introduces a new kernel
cannot change our numbers silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import onnx

from coreai_opt.onnx.rewrite.matmul_nbits_weight import INT8_EMULATED_SUFFIX

__all__ = ["Status", "KernelNumerics", "KERNELS", "kernel_numerics", "is_int8_compute"]


class Status(str, Enum):
    """How a kernel's numbers relate to the eager model's (see the module docstring)."""

    EXACT = "exact"
    EMULATED = "emulated"
    PINNED = "pinned"
    DIVERGES = "diverges"


@dataclass(frozen=True)
class KernelNumerics:
    """One onnxruntime kernel's entry.

    Attributes:
        op_type: ONNX op type.
        domain: ``""`` (ai.onnx), ``"com.microsoft"`` or ``"com.microsoft.nchwc"``.
        status: See :class:`Status`.
        integer_output: The kernel writes a quantized (integer) tensor, i.e. it is itself a quantizer stage.
        steps: Quantization steps it may add where its result is next rounded (0 for exact kernels, 1 otherwise).
        why: One line: what differs and why (shown in verify reports).
        absolute_error: A bound on ``|kernel(x) - f(x)|`` where the kernel's float approximation is accurate to an
            absolute rather than a relative error (0: not such a kernel). Where its result is rounded at a step ``s``
            finer than that, the approximation alone moves values by ``absolute_error / s`` steps
            (:func:`~coreai_opt.onnx.verify.quantizer_codes.rounding_width`).
    """

    op_type: str
    domain: str
    status: Status
    integer_output: bool
    steps: int
    why: str
    absolute_error: float = 0.0


def _entries(domain: str, status: Status, integer_output: bool, why: str, *ops: str,
             absolute_error: float = 0.0) -> list[KernelNumerics]:
    steps = 0 if status is Status.EXACT else 1
    return [KernelNumerics(op, domain, status, integer_output, steps, why, absolute_error) for op in ops]


#: MLAS's logistic function (onnxruntime's ``Sigmoid``, and the table ``QLinearSigmoid`` builds from it) is accurate
#: to an absolute error: measured at most 1.67e-7 on 2,000,001 points of [-40, 40] (relative error up to 6x in the
#: tail below -16, where sigmoid < 1.2e-7); ``tests/onnx/test_verify_logistic.py`` pins the bound.
LOGISTIC_ABSOLUTE_ERROR = 2e-7


_MOVES = "moves or selects values without arithmetic"
_IEEE = "one IEEE-754 correctly rounded float op per element, as in torch"
_FLOAT_ORDER = "float accumulation order differs from torch (oneDNN / ATen vs MLAS)"
_TRANSCENDENTAL = "float approximation of a transcendental function differs from torch's"
_REQUANT = "integer kernel: int32 accumulation requantised as round(acc·s_x·s_w/s_y), eager rounds float/s_y"
_ELEMENTWISE_REQUANT = "integer kernel: requantises through float scale ratios (eager: float op, then round)"
_DYNAMIC = "int32 accumulation of dynamically quantized uint8 activations (eager reproduces the quantization)"
_MATMULNBITS_FLOAT = "blocked-weight matmul computed in float (accuracy_level < 4)"
_MATMULNBITS_INT8 = ("accuracy_level=4: onnxruntime quantizes the activation to int8 per row and per K block "
                     "(amax/127) before the integer product; the eager model does not")

KERNELS: dict[tuple[str, str], KernelNumerics] = {
    (k.domain, k.op_type): k
    for k in (
        *_entries("", Status.EXACT, False, _MOVES, "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                  "Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile",
                  "Pad", "Shape", "Size", "Constant", "ConstantOfShape", "Range", "Cast", "Where", "MaxPool",
                  "GlobalMaxPool", "ReduceMax", "ReduceMin", "ArgMax", "ArgMin", "Dropout", "DepthToSpace",
                  "SpaceToDepth", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or"),
        *_entries("", Status.EXACT, False, _IEEE, "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Max", "Min",
                  "Clip", "Sqrt", "Floor", "Ceil", "Round", "Sign", "Reciprocal"),
        *_entries("", Status.EXACT, True, "the quantizer itself: bit-exact with the eager op (132-cell parity table)",
                  "QuantizeLinear"),
        *_entries("", Status.EXACT, False, "bit-exact with the eager op (132-cell parity table)", "DequantizeLinear"),
        *_entries("com.microsoft", Status.EXACT, True, "max-pooling of integers in NHWC layout", "NhwcMaxPool"),
        *_entries("com.microsoft", Status.EXACT, False, "gathers quantized rows, then (q - z)·s in float32 as "
                  "DequantizeLinear does: bit-exact", "GatherBlockQuantized"),
        *_entries("com.microsoft.nchwc", Status.EXACT, False, "layout change", "ReorderInput", "ReorderOutput"),
        *_entries("com.microsoft.nchwc", Status.EXACT, False, _MOVES, "MaxPool", "GlobalMaxPool", "Upsample"),
        *_entries("", Status.PINNED, False, _FLOAT_ORDER, "Conv", "ConvTranspose", "Gemm", "MatMul", "ReduceMean",
                  "ReduceSum", "GlobalAveragePool", "AveragePool", "LayerNormalization", "GroupNormalization",
                  "InstanceNormalization", "BatchNormalization", "Resize", "Einsum", "SimplifiedLayerNormalization"),
        *_entries("", Status.PINNED, False, _TRANSCENDENTAL, "Softmax", "LogSoftmax", "Gelu", "Erf", "Tanh",
                  "HardSigmoid", "HardSwish", "Exp", "Log", "Pow", "Elu", "LeakyRelu", "Softplus"),
        *_entries("", Status.PINNED, False, _TRANSCENDENTAL + " (MLAS's logistic: absolute error <= 2e-7)",
                  "Sigmoid", absolute_error=LOGISTIC_ABSOLUTE_ERROR),
        *_entries("com.microsoft", Status.PINNED, False, _FLOAT_ORDER, "FusedConv", "FusedGemm", "FusedMatMul",
                  "NhwcFusedConv", "SkipLayerNormalization", "SimplifiedLayerNormalization",
                  "SkipSimplifiedLayerNormalization", "BiasAdd", "Attention", "MultiHeadAttention"),
        *_entries("com.microsoft", Status.PINNED, False, _TRANSCENDENTAL, "BiasGelu", "FastGelu", "QuickGelu",
                  "BiasSoftmax"),
        *_entries("com.microsoft.nchwc", Status.PINNED, False, _FLOAT_ORDER, "Conv", "AveragePool",
                  "GlobalAveragePool"),
        *_entries("com.microsoft", Status.PINNED, True, _REQUANT, "QLinearConv", "QGemm", "NhwcQLinearConv"),
        *_entries("", Status.PINNED, True, _REQUANT, "QLinearConv", "QLinearMatMul"),
        *_entries("com.microsoft", Status.PINNED, True, _ELEMENTWISE_REQUANT, "QLinearAdd", "QLinearMul",
                  "QLinearConcat", "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearLeakyRelu",
                  "QLinearReduceMean", "QLinearWhere"),
        *_entries("com.microsoft", Status.PINNED, True, "lookup table of MLAS's logistic per input code (absolute "
                  "error <= 2e-7), requantised", "QLinearSigmoid", absolute_error=LOGISTIC_ABSOLUTE_ERROR),
        *_entries("com.microsoft", Status.EMULATED, True,
                  "lookup-table softmax requantised with floor(1/y_scale): exact for the power-of-two output step "
                  "the softmax quantizer uses", "QLinearSoftmax"),
        *_entries("", Status.EMULATED, True, "reproduced bit-exactly by coreai_opt::dynamic_quantize_dequantize",
                  "DynamicQuantizeLinear"),
        *_entries("com.microsoft", Status.EMULATED, False, _DYNAMIC, "DynamicQuantizeMatMul", "MatMulIntegerToFloat"),
        *_entries("", Status.EMULATED, False, _DYNAMIC, "MatMulInteger", "ConvInteger"),
        *_entries("com.microsoft", Status.PINNED, False, _MATMULNBITS_FLOAT, "MatMulNBits"),
    )
}

_MATMULNBITS_INT8_ENTRY = KernelNumerics("MatMulNBits", "com.microsoft", Status.DIVERGES, False, 1, _MATMULNBITS_INT8)
_MATMULNBITS_INT8_EMULATED = KernelNumerics(
    "MatMulNBits", "com.microsoft", Status.EMULATED, False, 1,
    "accuracy_level=4 written by the export for matmul_compute='int8': the eager model applies the same int8 "
    "activation quantization (Int8ComputeActivation); integer products, float accumulation order differs")
#: onnxruntime's ``accuracy_level`` that selects int8 compute (``SQNBIT_CompInt8``).
INT8_COMPUTE_ACCURACY_LEVEL = 4


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def kernel_numerics(node: onnx.NodeProto) -> KernelNumerics | None:
    """The table entry for ``node`` (None when its op type is unknown).

    ``MatMulNBits`` with ``accuracy_level=4`` (onnxruntime's default when it fuses ``DequantizeLinear → MatMul``)
    is ``diverges``, unless the export wrote it for an int8-compute linear (name ending in
    ``INT8_EMULATED_SUFFIX``: the eager model emulates its activation quantization), which is ``emulated``; with a
    lower accuracy level it computes in float (``pinned``).
    """
    entry = KERNELS.get((_domain(node), node.op_type))
    if entry is not None and node.op_type == "MatMulNBits" and entry.domain == "com.microsoft":
        level = next((int(a.i) for a in node.attribute if a.name == "accuracy_level"), 0)
        if level >= INT8_COMPUTE_ACCURACY_LEVEL:
            emulated = level == INT8_COMPUTE_ACCURACY_LEVEL and node.name.endswith(INT8_EMULATED_SUFFIX)
            return _MATMULNBITS_INT8_EMULATED if emulated else _MATMULNBITS_INT8_ENTRY
    return entry


def is_int8_compute(node: onnx.NodeProto) -> bool:
    """``node`` is an int8-compute ``MatMulNBits`` the eager model emulates (written for ``matmul_compute='int8'``)."""
    return kernel_numerics(node) is _MATMULNBITS_INT8_EMULATED
