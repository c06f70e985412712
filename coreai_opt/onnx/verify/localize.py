"""Where eager and onnxruntime first part: compare intermediate tensors at quantizer (or layer) boundaries.

Boundaries, in the exported graph's order:

* **quantizers**: every activation ``QuantizeLinear``. The exporter names the node behind it after the
  ``coreai_opt::quantize_dequantize`` call it translates (``namespace`` metadata ending in
  ``quantize_dequantize_7: coreai_opt.quantize_dequantize.default``: the 8th call of the op in the traced
  forward). Eager records every call of the op, in call order, with a dispatch mode, so a quantizer module called
  at several sites is compared per call site. The values compared are integers: onnxruntime's ``QuantizeLinear``
  output against ``round(eager / scale) + zero_point``.
* **layers** (only when the file has no activation quantizer, e.g. weight-only presets): the output of each
  weighted module (``nn.Linear``, ``nn.Conv*``, ...) call, eager from a forward hook, ONNX from the last node of
  that module's ``namespace`` scope; compared in float, relative to the eager range. Behind an int8-compute
  ``MatMulNBits`` only the part of the difference its derived int8 steps do not explain counts (rule
  ``"int8 compute"`` of :mod:`coreai_opt.onnx.verify.tolerance`), so a flipped input code is not a divergence.

onnxruntime computes them from a copy of the file with those tensors added as graph outputs. Adding an output can
change onnxruntime's fusions; :attr:`Divergence.fusions_unchanged` records whether the instrumented copy's
optimized graph has the same non-exact kernel counts as the original's, and ``str(divergence)`` warns when not.
Measured on the 35 zoo files with activation quantizers (7 models × fp8, w4a8, w8a8, w8a8_sym, w8a16): unchanged on
29 (a fused integer kernel writes the ``QuantizeLinear``'s output tensor itself); changed on six of the seven
``w8a8_sym`` files (int8 activations: onnxruntime then fuses a different set of convolutions / Gemms, e.g.
resnet18 8 ``QLinearConv`` → 0), so a divergence found there was measured on a differently fused graph. Layer
outputs (weight-only files) are float tensors and do change fusions (``MatMul + Add`` no longer fuse).

Each boundary is judged against its derived bound (:func:`coreai_opt.onnx.verify.tolerance.tensor_bounds`); the first
that exceeds it is the divergence, with the kernels onnxruntime ran between it and the boundaries before it and a
classified reason.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from coreai_opt.error_boundary import public_api
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.verify.cache_codes import cache_scales
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.onnx.verify.int8_compute_steps import beyond_int8_steps, int8_layer_inputs
from coreai_opt.onnx.verify.ort_kernels import Status, kernel_numerics
from coreai_opt.onnx.verify.tolerance import FLOAT_PRECISION, tensor_bounds

__all__ = ["Divergence", "localize_divergence"]

_CALL = re.compile(r"(?:^|/)quantize_dequantize(?:_(\d+))?: coreai_opt\.quantize_dequantize\.default$")
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.Embedding)
_WEIGHTED_NAMES = frozenset(f"{cls.__module__}.{cls.__qualname__}" for cls in _WEIGHTED)


@dataclass(frozen=True)
class Divergence:
    """The first boundary where eager and onnxruntime differ by more than its bound.

    Attributes:
        kind: ``"quantizer"`` or ``"layer"``.
        tensor: The ONNX tensor compared.
        node: The ONNX node that produces it (exported graph) and its op type, e.g. ``"node_q (QuantizeLinear)"``.
        module: The module path from the exporter's ``namespace`` metadata (``""`` for the top level).
        call: The traced call (``quantize_dequantize_7``) or the module call index (layers).
        difference: Measured difference: steps (quantizers) or fraction of the eager range (layers).
        allowed: The bound it exceeded, same unit.
        kernels: onnxruntime kernels between this boundary and the ones before it, by op type.
        reason: Classified cause.
        compared: Boundaries compared.
        fusions_unchanged: The instrumented copy kept onnxruntime's kernel counts.
    """

    kind: str
    tensor: str
    node: str
    module: str
    call: str
    difference: float
    allowed: float
    kernels: dict[str, int]
    reason: str
    compared: int
    fusions_unchanged: bool

    def __str__(self) -> str:
        unit = "step(s)" if self.kind == "quantizer" else "of its range"
        amount = f"{self.difference:.3g} {unit}" if self.kind == "quantizer" else f"{self.difference:.2e} {unit}"
        allowed = f"{self.allowed:g}" if self.kind == "quantizer" else f"{self.allowed:.0e}"
        text = (f"first divergence ({self.compared} {self.kind} boundaries compared): {self.kind} {self.call} "
                f"in module {self.module or '<top>'} at {self.node}, differs by {amount} (allowed {allowed}): "
                f"{self.reason}")
        return text if self.fusions_unchanged else text + " [the instrumented copy changed onnxruntime's fusions]"


@dataclass(frozen=True)
class Boundary:
    """One compared tensor: its producing node, module path, traced call index and (quantizers) qparams and axis."""

    tensor: str
    node: onnx.NodeProto
    module: str
    call: int
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    axis: int = 1


def _namespace(node: onnx.NodeProto) -> str:
    return next((p.value for p in node.metadata_props if p.key == "namespace"), "")


def _module_of(namespace: str) -> str:
    segments = namespace.split("/")[:-1]
    return segments[-1].split(":")[0].split("@")[0] if segments else ""


def _initializer(graph: OnnxGraph, name: str) -> np.ndarray | None:
    tensor = graph.initializer(name)
    return numpy_helper.to_array(tensor) if tensor is not None else None


def quantizer_boundaries(model: onnx.ModelProto) -> list[Boundary]:
    """Every activation ``QuantizeLinear`` traced from a ``coreai_opt::quantize_dequantize`` call, in graph order."""
    graph = OnnxGraph(model)
    found: list[Boundary] = []
    for node in graph.nodes:
        if node.op_type != "QuantizeLinear" or graph.initializer(node.input[0]) is not None:
            continue
        spaces = [_namespace(node)] + [_namespace(c) for c in graph.readers(node.output[0])]
        match = next((m for m in map(_CALL.search, spaces) if m), None)
        if match is None or graph.initializer(node.input[1]) is None:
            continue
        zero_point = _initializer(graph, node.input[2]) if len(node.input) > 2 else None
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 1)
        found.append(Boundary(node.output[0], node, _module_of(next(s for s in spaces if _CALL.search(s))),
                               int(match.group(1) or 0), _initializer(graph, node.input[1]), zero_point, axis))
    return found


def _layer_boundaries(model: onnx.ModelProto, modules: set[str]) -> list[Boundary]:
    """The last node of each contiguous run of nodes in a weighted module's scope (one run per call)."""
    runs: list[tuple[str, onnx.NodeProto]] = []
    for node in model.graph.node:
        module = _module_of(_namespace(node))
        if module in modules:
            if runs and runs[-1][0] == module:
                runs[-1] = (module, node)
            else:
                runs.append((module, node))
    calls: Counter[str] = Counter()
    found = []
    for module, node in runs:
        found.append(Boundary(node.output[0], node, module, calls[module]))
        calls[module] += 1
    return found


class _RecordQuantizeCalls(TorchDispatchMode):
    """Records the output of every ``coreai_opt::quantize_dequantize`` call, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.coreai_opt.quantize_dequantize.default:
            self.outputs.append(result.detach().clone())
        return result


def _eager_quantizer_outputs(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    recorder = _RecordQuantizeCalls()
    with torch.no_grad(), recorder:
        model(*batch)
    return recorder.outputs


def _weighted_scope(node: torch.fx.Node) -> str | None:
    """The module path of ``node`` when its innermost module (``nn_module_stack``) is a weighted layer."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    if isinstance(cls, str):  # torch.export stores the qualified class name
        return path if cls in _WEIGHTED_NAMES else None
    return path if isinstance(cls, type) and issubclass(cls, _WEIGHTED) else None


def _graph_layer_outputs(model: torch.fx.GraphModule,
                         batch: tuple[torch.Tensor, ...]) -> dict[tuple[str, int], torch.Tensor]:
    """Last node output of each contiguous run of nodes inside a weighted module's scope, one run per call."""
    runs: list[tuple[str, torch.fx.Node]] = []
    for node in model.graph.nodes:
        scope = _weighted_scope(node)
        if scope is None:
            continue
        if runs and runs[-1][0] == scope:
            runs[-1] = (scope, node)
        else:
            runs.append((scope, node))
    wanted: dict[torch.fx.Node, tuple[str, int]] = {}
    calls: Counter[str] = Counter()
    for scope, node in runs:
        wanted[node] = (scope, calls[scope])
        calls[scope] += 1
    outputs: dict[tuple[str, int], torch.Tensor] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            result = super().run_node(n)
            if n in wanted and isinstance(result, torch.Tensor):
                outputs[wanted[n]] = result.detach().clone()
            return result

    with torch.no_grad():
        _Recorder(model).run(*batch)
    return outputs


def _eager_layer_outputs(model: nn.Module, batch: tuple[torch.Tensor, ...],
                         modules: set[str]) -> dict[tuple[str, int], torch.Tensor]:
    if isinstance(model, torch.fx.GraphModule):
        return _graph_layer_outputs(model, batch)
    outputs: dict[tuple[str, int], torch.Tensor] = {}
    calls: Counter[str] = Counter()
    handles = []
    for name, module in model.named_modules():
        if name in modules:
            def hook(_m: nn.Module, _i: object, out: torch.Tensor, name: str = name) -> None:
                outputs[name, calls[name]] = out.detach().clone()
                calls[name] += 1
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(*batch)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _kernel_counts(path: Path) -> Counter[str]:
    graph = optimized_model(path, "all").graph
    return Counter(n.op_type for n in graph.node if (k := kernel_numerics(n)) is None or k.status is not Status.EXACT)


def instrumented_copy(model: onnx.ModelProto, tensors: list[str], directory: Path) -> Path:
    """Save a copy of ``model`` with ``tensors`` added as graph outputs into ``directory``; return its path."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return add_outputs_and_save(copy, tensors, directory)


def add_outputs_and_save(model: onnx.ModelProto, tensors: list[str], directory: Path) -> Path:
    """Add ``tensors`` to ``model``'s graph outputs (in place) and save it into ``directory``; return its path."""
    existing = {o.name for o in model.graph.output}
    for name in tensors:
        if name not in existing:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
    path = directory / "instrumented.onnx"
    onnx.save(model, str(path))
    return path


def non_exact_behind(graph: OnnxGraph, tensor: str, boundaries: set[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The non-exact kernels computing ``tensor``, walking back to the ``boundaries``; and the boundaries reached."""
    seen, stack, found, reached = set(), [tensor], [], set()
    while stack:
        node = graph.producer(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        entry = kernel_numerics(node)
        if entry is None or entry.status is not Status.EXACT:
            found.append(node)
        for name in node.input:
            if name in boundaries:
                reached.add(name)
            elif name:
                stack.append(name)
    return found, reached


def _local_kernels(optimized: onnx.ModelProto, tensor: str, boundaries: set[str]) -> Counter[str]:
    """Non-exact kernels that compute ``tensor`` from the boundaries (or inputs / constants) before it."""
    return Counter(node.op_type for node in non_exact_behind(OnnxGraph(optimized), tensor, boundaries)[0])


def _classify(kernels: Counter[str], optimized: onnx.ModelProto) -> str:
    entries = {n.op_type: kernel_numerics(n) for n in optimized.graph.node if n.op_type in kernels}
    diverging = [(op, e.why) for op, e in entries.items() if e is not None and e.status is Status.DIVERGES]
    if diverging:
        op, why = diverging[0]
        return f"an op onnxruntime computes differently: {op} ({why})"
    unknown = sorted(op for op, e in entries.items() if e is None)
    if unknown:
        return f"kernels missing from the ort_kernels table ({', '.join(unknown)})"
    requantizing = sorted(op for op, e in entries.items() if e.integer_output)
    if requantizing:
        return f"a kernel's requantisation rounding ({', '.join(requantizing)})"
    if kernels:
        return f"float accumulation order ({', '.join(sorted(kernels))})"
    return ("every op between the boundaries is exact, so the file does not compute what the eager model does "
            "(was it exported from this model?)")


def _steps_apart(b: Boundary, eager: torch.Tensor, got: np.ndarray) -> float:
    x = eager.detach().double().numpy()
    scale = b.scale.astype(np.float64)
    zero_point = (b.zero_point if b.zero_point is not None else np.zeros_like(scale)).astype(np.float64)
    if scale.size > 1 and scale.ndim == 1:
        shape = [1] * x.ndim
        shape[b.axis % x.ndim] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    if got.dtype.kind == "f" or got.dtype.itemsize == 1 and got.dtype.kind not in "iu":  # float8 as float
        return float(np.abs(got.astype(np.float64) * scale - x).max() / np.max(scale)) if x.size else 0.0
    q_eager = np.rint(x / scale) + zero_point
    return float(np.abs(got.astype(np.float64) - q_eager).max()) if x.size else 0.0


@public_api
def localize_divergence(model: nn.Module, path: str | Path, inputs: torch.Tensor | tuple[torch.Tensor, ...], *,
                        providers: Sequence[str] = ("CPUExecutionProvider",)) -> Divergence | None:
    """Find the first quantizer (or layer) where onnxruntime departs from the eager ``model`` beyond its bound.

    Args:
        model: The converted model that was exported.
        path: The ONNX file ``export_onnx`` wrote for it.
        inputs: One batch: a tensor or a tuple of tensors, one per model input.
        providers: onnxruntime execution providers.

    Returns:
        The first :class:`Divergence`, or None when every boundary is within its bound.

    Raises:
        FileNotFoundError: No file at ``path``.
    """
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"localize_divergence: no ONNX file at {path}; pass the path export_onnx returned")
    batch = inputs if isinstance(inputs, tuple) else (inputs,)
    exported = onnx.load(str(path))
    boundaries, kind = quantizer_boundaries(exported), "quantizer"
    if boundaries:
        eager_calls = _eager_quantizer_outputs(model, batch)
        eager = {b.tensor: eager_calls[b.call] for b in boundaries if b.call < len(eager_calls)}
    else:
        modules = {name for name, m in model.named_modules() if isinstance(m, _WEIGHTED)}
        if isinstance(model, torch.fx.GraphModule):  # functionalized layers: their scopes live in node metadata
            modules |= {scope for n in model.graph.nodes if (scope := _weighted_scope(n)) is not None}
        boundaries, kind = _layer_boundaries(exported, modules), "layer"
        by_call = _eager_layer_outputs(model, batch, modules)
        eager = {b.tensor: by_call[b.module, b.call] for b in boundaries if (b.module, b.call) in by_call}
    boundaries = [b for b in boundaries if b.tensor in eager]
    if not boundaries:
        return None
    int8_inputs = int8_layer_inputs(exported) if kind == "layer" else {}
    tensors = list(dict.fromkeys([b.tensor for b in boundaries] + list(int8_inputs.values())))
    with tempfile.TemporaryDirectory(prefix="coreai_opt_localize_") as tmp:
        instrumented = instrumented_copy(exported, tensors, Path(tmp))
        session = ort.InferenceSession(str(instrumented), providers=list(providers))
        feed = cache_scales(model, exported.graph).feed([i.name for i in session.get_inputs()], batch)
        computed = dict(zip(tensors, session.run(tensors, feed), strict=True))
        values = [computed[b.tensor] for b in boundaries]
        optimized = optimized_model(instrumented, "all")
        unchanged = _kernel_counts(instrumented) == _kernel_counts(path)
    bounds = tensor_bounds(optimized)
    tensors = {b.tensor for b in boundaries}
    for b, got in zip(boundaries, values, strict=True):
        ref = eager[b.tensor]
        # not the same tensor (an op the exporter rewrote), or no optimized node computes it (a folded constant)
        if tuple(ref.shape) != got.shape or (kind == "quantizer" and b.tensor not in bounds):
            continue
        if kind == "quantizer":
            difference, allowed = _steps_apart(b, ref, got), float(bounds[b.tensor].steps)
        else:
            span = float(ref.max() - ref.min()) if ref.numel() else 0.0
            apart = np.abs(got.astype(np.float64) - ref.double().numpy())
            layer = bounds[b.tensor].int8_layer if b.tensor in bounds else None
            if layer and layer in int8_inputs:  # behind int8 compute: only what its int8 steps do not explain
                apart = beyond_int8_steps(exported, layer, bounds[b.tensor].int8_steps,
                                          computed[int8_inputs[layer]], apart)
            difference = float(apart.max(initial=0.0)) / max(span, 1e-12)
            allowed = FLOAT_PRECISION
        if difference > allowed + 1e-3 * (kind == "quantizer"):
            kernels = _local_kernels(optimized, b.tensor, tensors - {b.tensor})
            call = f"quantize_dequantize_{b.call}" if kind == "quantizer" else f"{b.module} call {b.call}"
            return Divergence(kind, b.tensor, f"{b.node.name} ({b.node.op_type})", b.module, call, difference,
                              allowed, dict(kernels), _classify(kernels, optimized), len(boundaries), unchanged)
    return None
