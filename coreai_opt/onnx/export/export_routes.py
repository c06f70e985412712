"""Export routes: torch's dynamo exporter first, its TorchScript exporter when dynamo's decomposition fails.

``torch.onnx.export(dynamo=True)`` traces the model, then re-traces it through ONNX-friendly decompositions. That
second step can fail on graphs torch itself traced (torch 2.13: ``Cannot view a tensor with shape ... and strides
...``, a view recorded against one kernel's output strides and replayed on a decomposition with other strides).
The TorchScript exporter (``dynamo=False``) runs the real kernels instead and does not hit that class of bug, so
:func:`export_with_fallback` retries with it, with ONNX symbolics for coreai_opt's two custom ops:

* ``coreai_opt::quantize_dequantize`` -> ``QuantizeLinear -> DequantizeLinear`` (int8 / uint8, per tensor or per
  channel; a narrowed range such as int8 [-127, 127] adds the exact ``Max``/``Min`` clamp the dynamo
  translation uses; the int32 bias is ``Round(x / s)`` clipped, cast to INT32, then ``DequantizeLinear``);
* ``coreai_opt::dynamic_quantize_dequantize`` -> ``DynamicQuantizeLinear -> DequantizeLinear``.

Other dtypes (int4, int16, float8) and per-block scales need opset 21, which the TorchScript exporter does not
reach; for them the route fails and the error names both routes. A warning says when the TorchScript route ran.
Only decomposition failures are retried. A node the dynamo exporter has no ONNX function for (step 3/3, "Error when
translating node": e.g. an op on a complex-valued tensor, which ONNX cannot hold and torch's exporter translates
for a few ops only; ``custom_translation_table`` registers real-valued translations only, so coreai_opt cannot add
one) raises :class:`UntranslatableOpError` naming the op, why, and the model's source line, read from the exported
program's stack-trace metadata of that node. Every other failure (ours, or torch.export's capture) passes unchanged.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import onnx
import torch
from onnx import TensorProto
from torch import nn
from torch.onnx import symbolic_helper

from coreai_opt.errors import CoreaiOptRuntimeError
from coreai_opt.quantization.ops.quantize_dequantize_op import INT32_FLOAT_BOUNDS
from coreai_opt.quantization.spec.dtypes import get_dtype_info

__all__ = ["ExportRouteError", "UntranslatableOpError", "export_with_fallback", "torchscript_export",
           "TORCHSCRIPT_MAX_OPSET"]

#: Highest opset the TorchScript exporter writes.
TORCHSCRIPT_MAX_OPSET = 20
_TORCHSCRIPT_DTYPES = ("int8", "uint8", "int32")
#: What both routes return (the protobuf, possibly with what export computed alongside it).
Exported = TypeVar("Exported")
_QDQ = "coreai_opt::quantize_dequantize"
_DYNAMIC_QDQ = "coreai_opt::dynamic_quantize_dequantize"
_EXECUTING = re.compile(r"While executing %\S+ : .*?target=(?P<op>[\w.:]+)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n\s+(?P<code>.+)')


class ExportRouteError(CoreaiOptRuntimeError):
    """No export route could write the model; the message names the failing op, its source line and each route."""


class UntranslatableOpError(ExportRouteError):
    """torch's ONNX exporter has no translation for one node of the model; names the op, why and its source line."""


_TRANSLATING = re.compile(r"Error when translating node .*?target=(?P<op>[\w.:]+)")
_NO_FUNCTION = re.compile(r"Failure message: (?P<why>.+)")


def _translation_failure(exc: BaseException) -> tuple[str, str, str] | None:
    """``(op, why, source)`` when ``exc`` is the dynamo exporter failing to translate one node to ONNX, else None.

    ``source`` is the innermost frame of the node's ``stack_trace`` metadata (``file:line: code``) outside torch and
    coreai_opt (the model's line, not the tracer's), found on the node the exporter was translating (a local of its
    frame in the traceback), or ``"<unknown source line>"``.
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__
    translating = next((e for e in chain if _TRANSLATING.search(str(e))), None)
    if type(exc).__name__ != "ConversionError" or translating is None:
        return None
    op = _TRANSLATING.search(str(translating))["op"].removeprefix("torch.ops.")
    innermost = chain[-1]
    found = _NO_FUNCTION.search(str(innermost))
    why = found["why"].strip() if found else f"{type(innermost).__name__}: {_first_line_of(innermost)}"
    return op, why, _node_source(chain)


def _node_source(chain: list[BaseException]) -> str:
    """Where the node the exporter was translating comes from.

    The node is the local ``node`` of a frame in one of ``chain``'s tracebacks; the answer is the innermost frame of
    its ``stack_trace`` metadata outside torch and coreai_opt (``file:line: code``), else the module that called it
    (its ``nn_module_stack``), else ``"<unknown source line>"``.
    """
    for error in chain:
        tb = error.__traceback__
        while tb is not None:
            node = tb.tb_frame.f_locals.get("node")
            if isinstance(node, torch.fx.Node):
                frames = [f for f in _FRAME.findall(node.meta.get("stack_trace") or "") if not _is_library_file(f[0])]
                if frames:
                    return f"{frames[-1][0]}:{frames[-1][1]}: {frames[-1][2].strip()}"
                modules = list((node.meta.get("nn_module_stack") or {}).values())
                if modules:
                    path, kind = modules[-1]
                    return f"module {path or '<root>'} ({getattr(kind, '__name__', kind)})"
            tb = tb.tb_next
    return "<unknown source line>"


def _is_library_file(path: str) -> bool:
    """Whether ``path`` is torch's or coreai_opt's own code (tracing frames, not the model's)."""
    roots = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[2])  # a venv may be a symlink
    return any(Path(path).resolve().is_relative_to(root) for root in roots)


def _first_line_of(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _untranslatable(exc: BaseException) -> UntranslatableOpError | None:
    """The error of ours for a node torch's exporter cannot translate (None: ``exc`` is another failure)."""
    failure = _translation_failure(exc)
    if failure is None:
        return None
    op, why, source = failure
    namespace = op.split(".")[0]
    if "real-valued" in why:  # torch's wording when no function exists at all: the cause below says it
        why = ""
    if "complex" in why and "real-valued" not in why:
        cause = "ONNX has no complex tensors and torch's exporter translates only a few ops on them"
        fix = ("compute that part in real arithmetic (rotary embeddings with cos / sin instead of torch.polar / "
               "view_as_complex)")
    elif namespace not in ("aten", "prims"):
        cause = (f"it is a custom op of {namespace!r}, which torch's exporter cannot look inside and has no ONNX "
                 "function for")
        fix = (f"choose {namespace}'s plain-PyTorch implementation of that layer if it has one (a config or "
               "implementation switch), so torch.export records the ops inside it")
    else:
        cause = "torch's exporter has no ONNX function for it"
        fix = "rewrite that line with ops torch's exporter translates"
    return UntranslatableOpError(
        f"torch.onnx.export cannot translate op {op} (from {source}) to ONNX: {f'{why}; ' if why else ''}{cause}. "
        f"Fix: {fix}, or "
        "keep that code out of the exported model (export the part before it)")


def _is_decomposition_failure(exc: BaseException) -> bool:
    return type(exc).__name__ == "ConversionError" and "Failed to decompose" in str(exc)


def failure_site(exc: BaseException) -> str:
    """``op <target> (from <file>:<line>: <code>)`` of the node the exporter was running when it failed."""
    text = "\n".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    op = _EXECUTING.search(text)
    frames = _FRAME.findall(text)
    where = f" (from {frames[-1][0]}:{frames[-1][1]}: {frames[-1][2].strip()})" if frames else ""
    return f"op {op['op'] if op else '<unknown>'}{where}"


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def export_with_fallback(dynamo: Callable[[], Exported], torchscript: Callable[[], Exported]) -> Exported:
    """Run ``dynamo``; when its decomposition step fails, warn and run ``torchscript``.

    Raises:
        UntranslatableOpError: dynamo has no ONNX translation for a node (names the op, why and its source line).
        ExportRouteError: both routes failed; names the op and source line dynamo failed at and both errors.
    """
    try:
        return dynamo()
    except Exception as exc:
        untranslatable = _untranslatable(exc)
        if untranslatable is not None:
            raise untranslatable from exc
        if not _is_decomposition_failure(exc):
            raise
        dynamo_error = exc
    site = failure_site(dynamo_error)
    try:
        proto = torchscript()
    except Exception as exc:
        raise ExportRouteError(
            f"torch cannot export this model to ONNX by any route coreai_opt tried. Route 1, "
            f"torch.onnx.export(dynamo=True), failed decomposing {site}: {_first_line(dynamo_error)}. Route 2, "
            f"the TorchScript exporter (dynamo=False), failed: {_first_line(exc)}. Fix: rewrite that line (e.g. "
            "add .contiguous() before the view/reshape, or mark its module a leaf so it stays one op), or "
            "keep the model's quantizers to int8/uint8 at opset <= 20 so the TorchScript route can write them"
        ) from dynamo_error
    warnings.warn(
        f"torch.onnx.export(dynamo=True) failed decomposing {site} ({_first_line(dynamo_error)}, a torch exporter "
        "bug); coreai_opt exported the model with the TorchScript exporter (dynamo=False) instead. Check the file "
        "with coreai_opt.verify_onnx",
        UserWarning,
        stacklevel=4,
    )
    return proto


def _constant(g: object, value: float) -> object:
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _along(g: object, bound: object, x: object, axis: int, per_tensor: bool) -> object:
    """Reshape a per-channel ``[C]`` bound so it broadcasts along ``axis`` of ``x``."""
    if per_tensor:
        return bound
    rank = symbolic_helper._get_tensor_rank(x)
    shape = torch.tensor([-1] + [1] * (rank - axis - 1), dtype=torch.int64)
    return g.op("Reshape", bound, g.op("Constant", value_t=shape))


@symbolic_helper.parse_args("v", "v", "v", "i", "i", "i", "i", "s")
def _quantize_dequantize_symbolic(g: object, x: object, scale: object, zero_point: object, quant_min: int,
                                  quant_max: int, axis: int, block_size: int, dtype: str) -> object:
    if dtype not in _TORCHSCRIPT_DTYPES or block_size > 0:
        raise ValueError(f"the TorchScript route writes only {', '.join(_TORCHSCRIPT_DTYPES)} per-tensor or "
                         f"per-channel quantizers, the model has a {dtype} quantizer"
                         f"{f' with block_size={block_size}' if block_size > 0 else ''}")
    per_tensor = symbolic_helper._get_tensor_rank(scale) == 0
    axis = axis % symbolic_helper._get_tensor_rank(x)
    attrs = {} if per_tensor else {"axis_i": axis}
    if dtype == "int32":
        lo, hi = max(float(quant_min), INT32_FLOAT_BOUNDS[0]), min(float(quant_max), INT32_FLOAT_BOUNDS[1])
        q = g.op("Clip", g.op("Round", g.op("Div", x, scale)), _constant(g, lo), _constant(g, hi))
        return g.op("DequantizeLinear", g.op("Cast", q, to_i=TensorProto.INT32), scale, **attrs)
    info = get_dtype_info(dtype)
    zp = g.op("Cast", zero_point, to_i=info.onnx_type)
    y = g.op("DequantizeLinear", g.op("QuantizeLinear", x, scale, zp, **attrs), scale, zp, **attrs)
    if quant_min <= info.quant_min and quant_max >= info.quant_max:
        return y
    zf = g.op("Cast", zero_point, to_i=TensorProto.FLOAT)
    lo = g.op("Mul", g.op("Sub", _constant(g, float(quant_min)), zf), scale)
    hi = g.op("Mul", g.op("Sub", _constant(g, float(quant_max)), zf), scale)
    return g.op("Min", g.op("Max", y, _along(g, lo, x, axis, per_tensor)), _along(g, hi, x, axis, per_tensor))


def _dynamic_quantize_dequantize_symbolic(g: object, x: object) -> object:
    q, scale, zero_point = g.op("DynamicQuantizeLinear", x, outputs=3)
    return g.op("DequantizeLinear", q, scale, zero_point)


class _TensorState(nn.Module):
    """The model, with a ``state_dict`` of tensors only.

    The TorchScript tracer detaches every entry, and a quantizer's ``_extra_state`` is its spec dict.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> object:  # noqa: D102
        return self.model(*args)

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, object]:  # noqa: D102
        state = super().state_dict(*args, **kwargs)  # the caller's destination dict when it passes one
        for key in [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
            del state[key]
        return state


def torchscript_export(model: nn.Module, inputs: tuple[torch.Tensor, ...], opset: int,
                       axes: Sequence[dict[int, str]], input_names: list[str], output_names: list[str]
                       ) -> onnx.ModelProto:
    """Export with ``torch.onnx.export(dynamo=False)`` and the custom ops' symbolics (see the module docstring)."""
    if opset > TORCHSCRIPT_MAX_OPSET:
        raise ValueError(f"the TorchScript exporter writes opsets up to {TORCHSCRIPT_MAX_OPSET}, the model needs "
                         f"opset {opset}")
    buffer = io.BytesIO()
    dynamic_axes = {name: dict(spec) for name, spec in zip(input_names, axes, strict=True) if spec}
    torch.onnx.register_custom_op_symbolic(_QDQ, _quantize_dequantize_symbolic, opset)
    torch.onnx.register_custom_op_symbolic(_DYNAMIC_QDQ, _dynamic_quantize_dequantize_symbolic, opset)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
            torch.onnx.export(_TensorState(model), inputs, buffer, dynamo=False, opset_version=opset,
                              input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes)
    finally:
        torch.onnx.unregister_custom_op_symbolic(_QDQ, opset)
        torch.onnx.unregister_custom_op_symbolic(_DYNAMIC_QDQ, opset)
    return onnx.load_from_string(buffer.getvalue())
