"""Which axes of the exported ONNX graph's inputs are symbolic, and under which names.

Default, per graph input (position ``i`` of ``example_inputs``):

* a model captured with ``torch.export``: every dimension the capture kept symbolic
  (:attr:`~coreai_opt.graph.graph_meta.GraphMeta.dynamic_axes`, see ``coreai_opt.graph.dynamic_dims``: batch,
  sequence, height, width, ``<input>_dim<i>``), i.e. every size the model's code does not fix;
* any other model (FX capture, a plain module): dimension 0 only (an FX graph holds no sizes, so nothing says
  which other axes its code keeps generic);
* ``dynamic_batch=True`` adds dimension 0 as ``batch`` to every input of rank >= 1, ``False`` removes it.

``export_onnx(..., dynamic_shapes={"input_ids": {0: "batch", 1: "sequence"}, "mask": None})`` replaces the default
for the inputs it names (``None``: every dimension fixed at the example size). Inputs sharing an axis name share one
``torch.export.Dim``, so the exporter treats them as the same size.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import onnx
import torch
from torch import nn

from coreai_opt.graph.graph_meta import get_graph_meta

__all__ = ["DynamicShapes", "BATCH", "captured_bounds", "input_axes", "requested_axes", "torch_dynamic_shapes",
           "check_axes_are_dynamic"]

#: ``export_onnx``'s override: ``{graph input name: {dimension: axis name} | None}``.
DynamicShapes = Mapping[str, Mapping[int, str] | None]
#: Name of the symbolic batch dimension.
BATCH = "batch"


def _checked_override(name: str, axes: Mapping[int, str] | None, rank: int) -> dict[int, str]:
    if axes is None:
        return {}
    if not isinstance(axes, Mapping):
        raise TypeError(f"dynamic_shapes[{name!r}] must be a dict {{dimension: axis name}} or None, got "
                        f"{type(axes).__name__}; e.g. {{0: 'batch', 1: 'sequence'}}")
    for dim, axis in axes.items():
        if not isinstance(dim, int) or not -rank <= dim < rank:
            raise ValueError(f"dynamic_shapes[{name!r}] names dimension {dim!r}, but that input has rank {rank}")
        if not isinstance(axis, str) or not axis.isidentifier():
            raise ValueError(f"dynamic_shapes[{name!r}][{dim}] = {axis!r}: an axis name must be a Python identifier "
                             "such as 'sequence'")
    return {dim % rank: axis for dim, axis in axes.items()}


def input_axes(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    input_names: Sequence[str],
    dynamic_batch: bool,
    dynamic_shapes: DynamicShapes | None,
) -> list[dict[int, str]]:
    """The ``{dimension: axis name}`` of every graph input (see the module docstring for the rules).

    Raises:
        ValueError: ``dynamic_shapes`` names an unknown input, a dimension out of range or an invalid axis name.
        TypeError: ``dynamic_shapes`` is not a mapping, or one of its entries is not a dict or None.
    """
    if dynamic_shapes is not None and not isinstance(dynamic_shapes, Mapping):
        example = ", ".join(f"{name!r}: {{0: 'batch'}}" for name in input_names)
        raise TypeError(f"dynamic_shapes must be a dict keyed by graph input name, {{name: {{dimension: axis name}}}}, "
                        f"got a {type(dynamic_shapes).__name__} (torch.export's positional form is not accepted "
                        f"here); e.g. {{{example}}}")
    overrides = dict(dynamic_shapes or {})
    unknown = sorted(set(overrides) - set(input_names))
    if unknown:
        raise ValueError(f"dynamic_shapes names {unknown}, which are not inputs of the graph (its inputs: "
                         f"{list(input_names)})")
    meta = get_graph_meta(model)
    captured = meta.dynamic_axes if meta is not None else None
    arguments = list(meta.input_names) if captured else []
    axes: list[dict[int, str]] = []
    for i, (tensor, name) in enumerate(zip(inputs, input_names, strict=True)):
        if name in overrides:
            axes.append(_checked_override(name, overrides[name], tensor.dim()))
            continue
        default = dict(captured.get(arguments[i], {})) if captured and i < len(arguments) else {}
        default.pop(0, None)
        if dynamic_batch and tensor.dim() > 0:
            default[0] = BATCH
        axes.append(dict(sorted(default.items())))
    return axes


def torch_dynamic_shapes(axes: Sequence[dict[int, str]], bounds: Mapping[str, int] | None = None
                         ) -> tuple[dict[int, object] | None, ...] | None:
    """``torch.onnx.export``'s ``dynamic_shapes``: one ``torch.export.Dim`` per axis name (shared by name).

    ``bounds`` (:func:`captured_bounds`) gives an axis its largest size: ``Dim(name, max=bound)``.
    """
    if not any(axes):
        return None
    bounds = bounds or {}
    dims = {name: torch.export.Dim(name, max=bounds.get(name)) for spec in axes for name in spec.values()}
    return tuple({d: dims[name] for d, name in spec.items()} or None for spec in axes)


def captured_bounds(model: nn.Module, axes: Sequence[dict[int, str]]) -> dict[str, int]:
    """The capture's bounds (:attr:`~coreai_opt.graph.graph_meta.GraphMeta.axis_bounds`) that hold for ``axes``.

    A bound counts for an axis name only where every input dimension ``axes`` gives that name is the dimension the
    capture named so (input ``i`` is ``forward``'s argument ``i``): a caller's own name, or a captured name moved to
    another dimension, gets none.
    """
    meta = get_graph_meta(model)
    if meta is None or not meta.axis_bounds or not meta.dynamic_axes:
        return {}
    arguments = list(meta.input_names)
    named = {name for spec in axes for name in spec.values()}
    bounds = {name: bound for name, bound in meta.axis_bounds.items() if name in named}
    for i, spec in enumerate(axes):
        captured = meta.dynamic_axes.get(arguments[i], {}) if i < len(arguments) else {}
        for dim, name in spec.items():
            if captured.get(dim) != name:
                bounds.pop(name, None)
    return bounds


def requested_axes(input_names: Sequence[str], dynamic_batch: bool,
                   dynamic_shapes: DynamicShapes | None) -> list[set[int]]:
    """Per graph input, the dimensions the caller asked to keep dynamic.

    Every dimension of a ``dynamic_shapes`` entry, and dimension 0 when ``dynamic_batch`` is on; the rest of
    :func:`input_axes` is the capture's default.
    """
    overrides = dict(dynamic_shapes or {})
    requested = []
    for name in input_names:
        dims = {d for d in (overrides.get(name) or {}) if isinstance(d, int)}
        requested.append({d for d in dims if d >= 0} | ({0} if dynamic_batch else set()))
    return requested


def check_axes_are_dynamic(model_proto: onnx.ModelProto, axes: Sequence[dict[int, str]],
                           requested: Sequence[set[int]] | None = None) -> None:
    """Raise when an axis the caller asked for came out of the exporter as a constant; warn for a default one.

    ``requested`` (:func:`requested_axes`; None: every axis counts as asked for) separates the two.

    A ``torch.export`` capture keeps a size symbolic under ``Dim.AUTO`` even where the model's code constrains it
    (window padding whose guards hold only for some sizes, a size it branches on); the ONNX export asks for a
    free ``Dim`` and torch then fixes it at the example size. The file is right at that size (``verify_onnx``
    checks it), so only a size the caller named is an error.

    Raises:
        ValueError: names the input, the dimension and its constant, and the fix.
    """
    for i, (value, spec) in enumerate(zip(model_proto.graph.input, axes, strict=True)):
        dims = value.type.tensor_type.shape.dim
        for d, axis in spec.items():
            if d >= len(dims) or dims[d].dim_param:
                continue
            if requested is not None and d not in requested[i]:
                warnings.warn(
                    f"dimension {d} ({axis!r}) of input {value.name!r} is fixed at {dims[d].dim_value} in the ONNX "
                    "file: the capture kept it symbolic, but torch's exporter could not keep it free (the model's "
                    "code constrains it, e.g. window padding or a reshape to a literal size); the file runs at that "
                    f"size. Ask for it with dynamic_shapes={{{value.name!r}: {{{d}: {axis!r}}}}} to get an error "
                    "instead", UserWarning, stacklevel=4)  # past export_onnx and its public_api wrapper
                continue
            fix = ("export with dynamic_batch=False" if d == 0 else
                   f"export with dynamic_shapes={{{value.name!r}: {{...}}}} leaving dimension {d} out")
            raise ValueError(
                f"dimension {d} ({axis!r}) of input {value.name!r} was exported as the constant "
                f"{dims[d].dim_value}: the model's code fixes it (e.g. a reshape to a literal size); {fix}"
            )
