"""Capture a model as a ``torch.fx.GraphModule``: FX symbolic tracing, ``torch.export``, or FX then export.

* ``"fx"``: symbolic tracing with a tracer whose leaves are only *atomic* ``torch.nn`` modules (a class from
  ``torch.nn`` with no submodules: Conv*, Linear, Embedding, norms, activations, pooling, Dropout, ...) plus the
  user's ``leaf_modules``. Composite ``torch.nn`` modules (``nn.Sequential``, ``nn.TransformerEncoderLayer``,
  ``nn.MultiheadAttention``) are traced through, so their inner Linears can be quantized; when that fails
  (data-dependent control flow) ``"auto"`` falls back to export. Shapes and dtypes of every node are then
  recorded by running the example inputs through ``torch.fx.passes.shape_prop.ShapeProp``.
* ``"export"``: ``torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=...)`` with the batch
  dimension (dim 0) of every tensor input dynamic (``Dim.AUTO``), then ``.module()``; the ``_guards_fn``
  call the exporter adds is removed. The model is exported in eval mode.
* ``"auto"``: FX first, export if FX fails; the method used is logged and stored in ``gm.meta``.

The user model is copied exactly once and never touched again: deep-copied, or with ``share_parameters`` (what
post-training ``prepare`` uses) deep-copied except for its parameters, whose storage the copy shares
(:mod:`coreai_opt.graph.shared_parameters`; the passes bind new tensors instead of writing into them). Every node
gets a :class:`~coreai_opt.graph.node_meta.NodeMeta` holding the module that owns it (from ``nn_module_stack``).
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from coreai_opt.graph.capture_error import CaptureError, InplaceAliasError, ShapeGuardError
from coreai_opt.graph.dynamic_dims import axis_bounds, dynamic_axes
from coreai_opt.graph.dynamic_shapes_request import check_dynamic_shapes, export_dynamic_shapes, optional_dims
from coreai_opt.graph.graph_meta import GraphMeta, InputSpec, OutputLeaf, get_graph_meta, output_leaves, set_graph_meta
from coreai_opt.graph.node_meta import NodeMeta, set_meta
from coreai_opt.graph.op_effects import mutates
from coreai_opt.graph.savable_graph_module import SavableGraphModule
from coreai_opt.graph.shape_guards import check_shape_guards
from coreai_opt.graph.shared_parameters import copy_sharing_parameters
from coreai_opt.passes.functionalize_inplace import functionalize_inplace
from coreai_opt.passes.views_to_reshapes import views_to_reshapes

__all__ = ["capture", "CaptureError"]

logger = logging.getLogger(__name__)

_METHODS = ("auto", "fx", "export")
_TORCH_DIR = os.path.dirname(torch.__file__)


class _InplaceProxy(fx.Proxy):
    """A Proxy that records ``x += y`` as ``operator.iadd(x, y)``.

    ``fx.Proxy`` has no ``__iadd__``, so Python falls back to ``x = x + y`` and every other name of the old
    tensor silently keeps the old value; recording the in-place operator lets
    :func:`~coreai_opt.passes.functionalize_inplace.functionalize_inplace` rewire (or refuse) it.
    """


def _inplace_operator(op: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
              "irshift", "imatmul"):
    setattr(_InplaceProxy, f"__{_name}__", _inplace_operator(getattr(operator, _name)))


class _LeafTracer(fx.Tracer):
    """FX tracer whose leaves are atomic torch.nn modules and the user's leaf modules.

    It records each node's source line (``node.stack_trace``) for error messages, reads buffers through
    ``get_attr`` nodes (so that ``self.buf.add_(1)`` is recorded instead of running on the real buffer while
    tracing), and its arguments have defaults because ``pickle`` re-creates a GraphModule's tracer class without
    arguments.
    """

    def __init__(self, leaf_types: tuple[type, ...] = (), leaf_names: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names
        self.failed_in: tuple[str, str] | None = None
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True

    def proxy(self, node: fx.Node) -> fx.Proxy:  # noqa: D102
        return _InplaceProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:  # noqa: D102
        if module_qualified_name in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        atomic = type(m).__module__.startswith("torch.nn.") and next(m.children(), None) is None
        return atomic

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: D102
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # innermost module wins
                self.failed_in = (self.path_of_module(m) or "<root>", type(m).__name__)
            raise


def _culprit_frame(exc: BaseException, skip_torch: bool) -> str:
    """Return ``file:line: code`` of the innermost frame outside torch.fx (or outside torch when asked)."""
    frames = traceback.extract_tb(exc.__traceback__)
    fx_dir = os.path.join(_TORCH_DIR, "fx")
    for frame in reversed(frames):
        inside = frame.filename.startswith(_TORCH_DIR if skip_torch else fx_dir)
        if not inside and not frame.filename.startswith("<eval_with_key>"):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "<unknown>"


def _split_leaves(leaf_modules: Sequence[type | str]) -> tuple[tuple[type, ...], frozenset[str]]:
    types: list[type] = []
    names: set[str] = set()
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        elif isinstance(leaf, str):
            names.add(leaf)
        else:
            raise TypeError(
                f"leaf_modules entries must be nn.Module subclasses or qualified module names, got {leaf!r}"
            )
    return tuple(types), frozenset(names)


def _capture_fx(
    model: nn.Module,
    example: ExampleCall,
    leaf_modules: Sequence[type | str],
    concrete_args: dict[str, Any] | None,
) -> fx.GraphModule:
    tracer = _LeafTracer(*_split_leaves(leaf_modules))
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        where = tracer.failed_in
        module = f"module '{where[0]}' ({where[1]})" if where else f"'{type(model).__name__}.forward'"
        raise CaptureError(
            f"FX tracing failed in {module} at {_culprit_frame(exc, skip_torch=False)}: {type(exc).__name__}: {exc}"
        ) from exc
    gm = SavableGraphModule(tracer.root, graph, type(model).__name__)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = list(example.signature.parameters)
    bound = {**example.with_defaults, **(concrete_args or {})}
    for placeholder, name in zip(placeholders, names, strict=False):
        if name in (concrete_args or {}):  # FX keeps a placeholder that asserts the value: default it to the value
            placeholder.args = (concrete_args[name],)
    gm.recompile()
    # Clones: an in-place op on an input must not write into the caller's example tensors.
    inputs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone,
                                               [bound.get(name) for name in names[: len(placeholders)]])
    was_training = gm.training
    gm.eval()  # never update BN statistics while recording shapes
    buffers = {name: b.clone() for name, b in gm.named_buffers()}  # forward may write into buffers (counters)
    try:
        with torch.no_grad():
            outputs = output_leaves(ShapeProp(gm).propagate(*inputs))
    except Exception as exc:
        raise CaptureError(
            f"the FX graph of {type(model).__name__} traced but failed to run on the example inputs at "
            f"{_culprit_frame(exc, skip_torch=False)}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        gm.train(was_training)
        with torch.no_grad():
            for name, value in gm.named_buffers():
                value.copy_(buffers[name])
    set_graph_meta(gm, GraphMeta(capture="fx", outputs=outputs))
    return functionalize_inplace(gm).graph_module


@dataclass(frozen=True)
class ExampleCall:
    """The example inputs bound to ``forward``'s signature, once per capture.

    Attributes:
        args: Positional example inputs.
        kwargs: Keyword example inputs.
        signature: ``inspect.signature(model.forward)``.
        given: Parameter name -> the value the caller passed (no defaults).
        with_defaults: ``given`` plus every defaulted parameter.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    signature: inspect.Signature
    given: dict[str, Any]
    with_defaults: dict[str, Any]

    @classmethod
    def bind(cls, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExampleCall:
        """Bind ``args`` / ``kwargs`` to ``model.forward`` (``TypeError`` from :mod:`inspect` when they do not fit)."""
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
        given = dict(bound.arguments)
        bound.apply_defaults()
        return cls(args, kwargs, signature, given, dict(bound.arguments))

    def input_specs(self) -> tuple[InputSpec, ...]:
        """Name, dtype and shape of every tensor the caller passed (what later inputs are checked against)."""
        return tuple(InputSpec(name, str(value.dtype).removeprefix("torch."), tuple(value.shape))
                     for name, value in self.given.items() if isinstance(value, torch.Tensor))


def _export_program(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], spec: dict[str, Any]
                    ) -> torch.export.ExportedProgram:
    was_training = model.training
    model.eval()
    try:
        # Size-oblivious: a comparison of a dynamic size with 0 or 1 becomes a guard (checked below) instead of
        # the exporter's silent assumption that the size is never 0 or 1.
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=spec)
    except Exception as exc:
        raise CaptureError(
            f"torch.export failed at {_culprit_frame(exc, skip_torch=True)}: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        ) from exc
    finally:
        model.train(was_training)


def _mutates(program: torch.export.ExportedProgram) -> bool:
    return any(mutates(n) for n in program.graph.nodes if n.op == "call_function")


def _export_outputs(exported: fx.GraphModule, out_spec: pytree.TreeSpec) -> tuple[OutputLeaf, ...] | None:
    """The exported program's return value as leaves: its flat outputs' example values in ``out_spec``'s structure.

    None when an output node carries no example value (the exporter then learns the outputs by running the model).
    """
    output = next(n for n in reversed(exported.graph.nodes) if n.op == "output")
    flat = list(pytree.tree_leaves(output.args[0]))
    if any(isinstance(a, fx.Node) and "val" not in a.meta for a in flat) or len(flat) != out_spec.num_leaves:
        return None
    values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in flat]
    return output_leaves(pytree.tree_unflatten(values, out_spec))


def _capture_export(model: nn.Module, example: ExampleCall, dynamic_shapes: dict[str, Any] | None = None
                    ) -> fx.GraphModule:
    was_training = model.training
    spec = export_dynamic_shapes(example.given, dynamic_shapes)
    optional = {f"{name}.size({d})": (name, d) for name, dims in optional_dims(example.given, dynamic_shapes).items()
                for d in dims}
    while True:
        program = _export_program(model, example.args, example.kwargs, spec)
        guarded = check_shape_guards(program, type(model).__name__, frozenset(optional))
        if not guarded:
            break
        for text in guarded:  # forward branches on a size the user did not ask for: capture it at its example size
            name, dim = optional.pop(text)
            spec[name] = {d: v for d, v in spec[name].items() if d != dim} or None
            logger.info("%s is captured static: %s.forward branches on it", text, type(model).__name__)
    if _mutates(program):  # in-place ops, writes into views, out= calls: torch's functionalization replays them
        program = program.run_decompositions({})
    axes = dynamic_axes(program, list(example.signature.parameters))
    bounds = axis_bounds(program, list(example.signature.parameters))
    exported = program.module()
    outputs = _export_outputs(exported, program.call_spec.out_spec)
    # A plain GraphModule (same graph, same pytree codegen) so that train()/eval() work like any module and
    # pickle / torch.save store it (see savable_graph_module).
    gm = SavableGraphModule(exported, exported.graph, type(model).__name__)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()
    gm.train(was_training)
    set_graph_meta(gm, GraphMeta(capture="export", dynamic_axes=axes, axis_bounds=bounds, outputs=outputs))
    gm = functionalize_inplace(gm).graph_module
    return views_to_reshapes(gm).graph_module  # the traced views assumed the strides of torch's kernels


def _record_scopes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Store the owning module (name and type) of every node as its initial NodeMeta."""
    types = {name: type(m) for name, m in model.named_modules()}
    for node in gm.graph.nodes:
        name: str | None = None
        if node.op == "call_module":
            name = str(node.target)
        else:
            stack = node.meta.get("nn_module_stack")
            if stack:
                path = list(stack.values())[-1][0]
                name = path if path in types and path != "" else None
        set_meta(node, NodeMeta(module_name=name, module_type=types.get(name) if name is not None else None))


def capture(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    method: str = "auto",
    leaf_modules: Sequence[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
    dynamic_shapes: dict[str, Any] | None = None,
    share_parameters: bool = False,
) -> fx.GraphModule:
    """Copy ``model`` once and capture the copy as a GraphModule.

    Args:
        model: The user model (never modified).
        example_args: Positional example inputs (a tuple).
        example_kwargs: Keyword example inputs.
        method: ``"auto"`` (FX, then export), ``"fx"`` or ``"export"``.
        leaf_modules: Extra module types or qualified names FX keeps as single ``call_module`` nodes.
        concrete_args: Arguments FX specialises on (e.g. Python flags that drive control flow).
        dynamic_shapes: For the torch.export capture: per-argument entries in ``torch.export``'s format that
            replace the default (dimension 0 of every tensor dynamic), e.g. ``{"x": None}`` keeps ``x`` static and
            ``{"ids": {0: Dim.AUTO, 1: Dim.AUTO}}`` makes two dimensions dynamic. FX graphs are size-generic.
        share_parameters: The copy's parameters share storage with ``model``'s (no second copy of the weights);
            for callers that only read the weights (post-training quantization).

    Returns:
        The GraphModule, with ``GraphMeta(capture="fx" | "export", input_names=(...), input_specs=(...))`` in
        ``gm.meta["coreai_opt"]`` (:mod:`coreai_opt.graph.graph_meta`); the example inputs are bound to
        ``forward``'s signature once (:class:`ExampleCall`), and every later step reads what was recorded.

    Raises:
        TypeError: ``example_args`` is not a tuple.
        ValueError: unknown ``method``.
        CaptureError: capture failed; the message names the module and source line and suggests a fix.

    Example:
        >>> gm = capture(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), (torch.randn(1, 4),))
        >>> from coreai_opt.graph.graph_meta import get_graph_meta
        >>> get_graph_meta(gm).capture, [n.op for n in gm.graph.nodes]
        ('fx', ['placeholder', 'call_module', 'call_module', 'output'])
    """
    if not isinstance(example_args, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of positional inputs, got {type(example_args).__name__}; "
            "wrap a single tensor as (x,)"
        )
    if method not in _METHODS:
        raise ValueError(f"capture={method!r} is not one of {_METHODS}")
    check_dynamic_shapes(model, dynamic_shapes)
    example = ExampleCall.bind(model, example_args, dict(example_kwargs or {}))
    copied = copy_sharing_parameters(model) if share_parameters else copy.deepcopy(model)
    errors: list[str] = []
    gm: fx.GraphModule | None = None
    used = method
    if method in ("auto", "fx"):
        try:
            gm, used = _capture_fx(copied, example, leaf_modules, concrete_args), "fx"
        except InplaceAliasError as exc:
            if method == "fx":
                raise
            logger.info("FX cannot functionalize %s (%s); falling back to torch.export", type(model).__name__, exc)
            errors.append(str(exc))
        except CaptureError as exc:
            if method == "fx":
                raise CaptureError(f"{exc}. Add the module to leaf_modules or pass concrete_args.") from exc
            logger.info("FX capture of %s failed (%s); falling back to torch.export", type(model).__name__, exc)
            errors.append(str(exc))
    if gm is None:
        try:
            gm, used = _capture_export(copied, example, dynamic_shapes), "export"
        except ShapeGuardError:
            raise
        except CaptureError as exc:
            errors.append(str(exc))
            raise CaptureError(
                f"cannot capture {type(model).__name__}: " + " | ".join(errors)
                + ". Fix: mark the offending module as a leaf (leaf_modules=[...]), specialise Python flags with "
                "concrete_args={...}, or remove data-dependent control flow from forward."
            ) from exc
    logger.info("captured %s with %s", type(model).__name__, used)
    _record_scopes(gm, copied)
    names = [p for p in example.signature.parameters if p not in (concrete_args or {})]
    captured = get_graph_meta(gm)  # the capture records the outputs; torch.export also its symbolic axes
    set_graph_meta(gm, replace(captured or GraphMeta(capture=used), capture=used, input_names=tuple(names),
                               input_specs=example.input_specs()))
    return gm
